"""Records in, record out: `streamed_record_mean` against decode + streamed mean + encode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from fl.wire.records import (
    Layout,
    array_to_numpy,
    arrays_to_vector,
    numpy_to_array,
    vector_to_arrays,
)
from fl.wire.streaming import (
    COMPILED_MIN,
    _blank_bytes,
    _compiled_mean,
    _torch_mean,
    streamed_record_mean,
    streamed_weighted_mean,
)


def _replies(shapes: dict[str, tuple[int, ...]], count: int) -> list[ArrayRecord]:
    rng = np.random.default_rng(3)
    return [
        ArrayRecord(
            {
                k: numpy_to_array(rng.standard_normal(s).astype(np.float32) * 10)
                for k, s in shapes.items()
            }
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    "shapes",
    [
        {"w": (COMPILED_MIN // 512 + 3, 512), "b": (7,), "v": (1000, 3)},  # read in place
        {"w": (64, 33), "b": (7,)},  # small: through decoded vectors
    ],
)
def test_the_record_mean_gives_the_decoded_mean_s_bits(shapes):
    records = _replies(shapes, 4)
    layout = Layout.of({k: torch.from_numpy(v.numpy()) for k, v in records[0].items()})
    weights = torch.tensor([3, 100, 17, 1])
    mean = streamed_record_mean(records, weights, layout)
    decoded = [arrays_to_vector(r, layout) for r in records]
    reference = vector_to_arrays(streamed_weighted_mean(decoded, weights), layout)
    assert list(mean.keys()) == list(reference.keys())
    for name in reference:
        assert mean[name].data == reference[name].data  # header and every bit


def _layout(record: ArrayRecord) -> Layout:
    return Layout.of({k: torch.from_numpy(v.numpy()) for k, v in record.items()})


@pytest.mark.parametrize(
    ("shapes", "count"),
    [
        ({"huge": (COMPILED_MIN + 3 * 2048 + 5,)}, 5),  # one tensor; ragged last block
        ({f"t{i}": (i % 7 + 1, 2 * i + 1) for i in range(300)} | {"w": (COMPILED_MIN,)}, 6),
        ({"w": (1031, 1021), "e": (0,), "s": ()}, 1),  # one reply; empty and 0-d tensors
        ({"w": (1031, 1021), "b": (3,)}, 9),  # two groups of four
        ({"w": (1031, 1021), "b": (3,)}, 3),  # no full group: one reply at a time
    ],
)
def test_the_record_mean_gives_torch_s_bits(shapes, count):
    # The independent reference: torch's float64 multiply-add, reply by reply, on decoded
    # vectors, encoded by `vector_to_arrays`; the kernel groups replies, torch does not.
    records = _replies(shapes, count)
    layout = _layout(records[0])
    weights = torch.tensor([7 + 13 * i * i for i in range(count)])
    mean = streamed_record_mean(records, weights, layout)
    decoded = [arrays_to_vector(r, layout) for r in records]
    scale = (weights.double() / weights.double().sum()).tolist()
    reference = vector_to_arrays(_torch_mean(decoded, scale), layout)
    assert list(mean.keys()) == list(reference.keys())
    for name in reference:
        assert type(mean[name].data) is bytes
        assert mean[name].data == reference[name].data, name
        assert mean[name].object_id == reference[name].object_id  # Flower's content hash
        np.testing.assert_array_equal(mean[name].numpy(), array_to_numpy(reference[name]))
    # the record's bytes are its own: averaging again leaves them as they are
    kept = {name: bytes(array.data) for name, array in mean.items()}
    streamed_record_mean(records[::-1], weights.flip(0), layout)
    assert all(mean[name].data == kept[name] for name in kept)


def test_the_compiled_mean_refuses_what_it_cannot_address():
    out = np.empty(8, np.float32)
    ok = [np.ones(8, np.float32), np.ones(8, np.float32)]
    for bad in (np.ones(9, np.float32), np.ones(8, np.float64), np.ones(16, np.float32)[::2]):
        with pytest.raises(ValueError, match="contiguous float32"):
            _compiled_mean(np.array([out.ctypes.data]), [[ok[0], bad]], [8], [0.5, 0.5])
    _compiled_mean(np.array([out.ctypes.data]), [ok], [8], [0.25, 0.75])
    assert (out == 1).all()
    with pytest.raises(ValueError, match="payload of 0 bytes"):
        _blank_bytes(0)


def test_the_record_mean_checks_every_reply():
    shapes = {"w": (COMPILED_MIN // 512 + 3, 512), "b": (7,)}
    records = _replies(shapes, 3)
    layout = Layout.of({k: torch.from_numpy(v.numpy()) for k, v in records[0].items()})
    records[2]["b"] = numpy_to_array(np.zeros(8, np.float32))  # wrong shape
    with pytest.raises(ValueError, match="b: shape"):
        streamed_record_mean(records, torch.ones(3), layout)
    del records[1]["w"]
    with pytest.raises(ValueError, match="keys differ"):
        streamed_record_mean(records, torch.ones(3), layout)
    with pytest.raises(ValueError, match="no records"):
        streamed_record_mean([], torch.ones(0), layout)
