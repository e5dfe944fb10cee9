"""Records in, record out: `streamed_record_mean` against decode + streamed mean + encode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from fl.wire.records import Layout, arrays_to_vector, numpy_to_array, vector_to_arrays
from fl.wire.streaming import COMPILED_MIN, streamed_record_mean, streamed_weighted_mean


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
