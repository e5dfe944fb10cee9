"""The codec registry: round trips, byte figures by hand, composition, rejections."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl.wire.codec import (
    Codec,
    CodecError,
    Options,
    Payload,
    Traffic,
    codec_names,
    declared_traffic,
    decode,
    encode,
    encode_control,
    encode_dense,
    encode_grouped,
    encode_lowrank,
    encode_masked,
    encode_sparse,
    encode_topk,
    payload_traffic,
    read,
    register_codec,
    require,
    with_control,
)
from fl.wire.records import Layout, array_to_numpy, numpy_to_array

STATE = {"w": torch.zeros(6, 8), "b": torch.zeros(8), "steps": torch.tensor(7)}
LAYOUT = Layout.of(STATE)  # 56 float32 scalars and one int64: d = 57
D = LAYOUT.numel


@pytest.fixture
def vector() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    out = torch.randn(D, generator=generator)
    out[-1] = 7.0  # the integer buffer holds an integer
    return out


@pytest.fixture
def base() -> torch.Tensor:
    return torch.full((D,), -1.0)


def content(payload: Payload) -> RecordDict:
    return RecordDict(payload)


def tampered(payload: Payload, **arrays: np.ndarray | None) -> RecordDict:
    """The payload with arrays replaced (or removed, for None): a malicious sender."""
    record = payload["arrays"]
    assert isinstance(record, ArrayRecord)
    changed = dict(record)
    for name, value in arrays.items():
        if value is None:
            del changed[name]
        else:
            changed[name] = numpy_to_array(value)
    return RecordDict({**payload, "arrays": ArrayRecord(changed)})


def measured(payload: Payload) -> Traffic:
    """Traffic the receiver measures, after checking the sender declared the same."""
    received = content(payload)
    traffic = payload_traffic(received)
    assert declared_traffic(received) == traffic
    return traffic


# ----- round trips and byte figures -----------------------------------------------------
def test_dense_is_flower_arrays_with_true_dtype_sizes(vector):
    payload = encode_dense(vector, LAYOUT)
    assert measured(payload) == Traffic(56 * 4 + 8, 0)  # float32 values, int64 counter
    assert torch.equal(decode(content(payload), LAYOUT), vector)
    state = payload["arrays"].to_torch_state_dict()  # type: ignore[union-attr]
    assert list(state) == ["w", "b", "steps"] and state["steps"].dtype == torch.int64


def test_dense_float64_tensor_counts_eight_bytes():
    layout = Layout.of({"x": torch.zeros(5, dtype=torch.float64)})
    vector = torch.arange(5.0)
    payload = encode_dense(vector, layout)
    assert measured(payload) == Traffic(40, 0)
    assert torch.equal(decode(content(payload), layout), vector)


def test_masked_round_trip_with_shipped_or_held_mask(vector, base):
    mask = torch.arange(D) % 4 == 0  # 15 active scalars
    shipped = encode_masked(vector, mask, ship_mask=True)
    assert measured(shipped) == Traffic(15 * 4, 8)  # bitmap: ceil(57 / 8) bytes
    expected = torch.where(mask, vector, base)
    assert torch.equal(decode(content(shipped), LAYOUT, base=base), expected)
    held = encode_masked(vector, mask, ship_mask=False)
    assert measured(held) == Traffic(15 * 4, 0)
    assert torch.equal(decode(content(held), LAYOUT, base=base, mask=mask), expected)


def test_sparse_is_4k_payload_and_4k_control(vector, base):
    indices = torch.tensor([0, 3, 10, 56])
    payload = encode_sparse(vector, indices)
    assert measured(payload) == Traffic(4 * 4, 4 * 4)  # float32 values, int32 indices
    out = decode(content(payload), LAYOUT, base=base)
    assert torch.equal(out[indices], vector[indices])
    assert out.sum() == vector[indices].sum() - (D - 4)


def test_topk_picks_largest_changes_ties_to_lower_index(base):
    change = torch.zeros(D)
    change[[2, 9, 30, 41]] = torch.tensor([-7.0, 5.0, 5.0, 1.0])
    vector = base + change
    payload = encode_topk(vector, base, k=2)
    arrays = payload["arrays"]
    assert array_to_numpy(arrays["indices"]).tolist() == [2, 9]  # type: ignore[index]
    assert payload["codec"]["name"] == "topk"  # type: ignore[index]
    out = decode(content(payload), LAYOUT, base=base)
    assert torch.equal(out[[2, 9]], vector[[2, 9]]) and out[30] == -1.0
    renamed = RecordDict({**payload, "codec": ConfigRecord({**payload["codec"], "name": "sparse"})})
    assert torch.equal(decode(renamed, LAYOUT, base=base), out)
    by_fraction = encode_topk(vector, base, fraction=0.05)  # ceil(0.05 * 57) = 3
    assert array_to_numpy(by_fraction["arrays"]["indices"]).tolist() == [2, 9, 30]  # type: ignore[index]


def test_grouped_sends_one_array_per_key_smallest_first(vector):
    keys = torch.tensor([5, -1, 2] * 19)
    payload = encode_grouped(vector, keys)
    assert list(payload["arrays"]) == ["g-1", "g2", "g5"]  # type: ignore[arg-type]
    assert measured(payload) == Traffic(D * 4, 0)
    assert torch.equal(decode(content(payload), LAYOUT, groups=keys), vector)


def q8_error_bound(values: torch.Tensor) -> float:
    return float(values.abs().max()) / 127 / 2 * (1 + 1e-5)  # half a step, float rounding


def test_masked_q8_composes_and_bounds_the_error(vector, base):
    mask = torch.arange(D) % 2 == 0  # 29 active scalars
    payload = encode(vector, "masked+q8", mask=mask, ship_mask=True)
    assert measured(payload) == Traffic(29 + 4, 8)  # int8 codes and a float32 scale
    out = decode(content(payload), LAYOUT, base=base)
    assert torch.equal(out[~mask], base[~mask])
    assert (out[mask] - vector[mask]).abs().max() <= q8_error_bound(vector[mask])


def test_dense_q8_quantises_float_tensors_and_keeps_integers_raw(vector):
    payload = encode(vector, "dense+q8", layout=LAYOUT)
    assert measured(payload) == Traffic(48 + 4 + 8 + 4 + 8, 0)  # w, w:scale, b, b:scale, steps
    out = decode(content(payload), LAYOUT)
    assert out[-1] == 7.0
    w, b = vector[:48], vector[48:56]
    assert (out[:48] - w).abs().max() <= q8_error_bound(w)
    assert (out[48:56] - b).abs().max() <= q8_error_bound(b)


def test_sparse_q8_and_zero_scale(base):
    payload = encode(torch.zeros(D), "sparse+q8", indices=torch.tensor([1, 2, 3]))
    assert measured(payload) == Traffic(3 + 4, 3 * 4)
    out = decode(content(payload), LAYOUT, base=base)
    assert torch.equal(out[1:4], torch.zeros(3)) and out[0] == -1.0


def test_f16_halves_bytes_within_float16_precision(vector, base):
    payload = encode(vector, "topk+f16", base=base, k=10)
    assert measured(payload) == Traffic(10 * 2, 10 * 4)
    out = decode(content(payload), LAYOUT, base=base)
    changed = out != base
    assert int(changed.sum()) == 10
    assert torch.allclose(out[changed], vector[changed], rtol=2**-11, atol=0)


def test_lowrank_is_exact_for_a_rank_r_matrix(vector):
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(6, 2, generator=generator) @ torch.randn(2, 8, generator=generator)
    vector = torch.cat([w.reshape(-1), vector[48:]])
    payload = encode_lowrank(vector, LAYOUT, rank=2)
    assert set(payload["arrays"]) == {"w:U", "w:V", "b", "steps"}  # type: ignore[arg-type]
    assert measured(payload) == Traffic(2 * (6 + 8) * 4 + 8 * 4 + 8, 0)
    out = decode(content(payload), LAYOUT)
    assert torch.allclose(out, vector, atol=1e-5) and torch.equal(out[48:], vector[48:])


def test_lowrank_error_is_the_truncated_svd_error(vector):
    out = decode(content(encode_lowrank(vector, LAYOUT, rank=3)), LAYOUT)
    singular = torch.linalg.svdvals(vector[:48].reshape(6, 8).double())
    optimal = float(singular[3:].square().sum().sqrt())  # Eckart-Young
    assert math.isclose(float((out[:48] - vector[:48]).norm()), optimal, rel_tol=1e-4)


def test_lowrank_sends_dense_when_factors_are_not_smaller(vector):
    payload = encode_lowrank(vector, LAYOUT, rank=4)  # 4 * (6 + 8) = 56 > 48
    assert set(payload["arrays"]) == {"w", "b", "steps"}  # type: ignore[arg-type]
    assert torch.equal(decode(content(payload), LAYOUT), vector)


def test_control_records_count_as_control(vector):
    control = encode_control({"periods": torch.ones(D, dtype=torch.int16), "m": np.zeros(3)})
    payload = with_control(encode_dense(vector, LAYOUT), "pas", control)
    assert measured(payload) == Traffic(56 * 4 + 8, D * 2 + 3 * 8)


# ----- registry ---------------------------------------------------------------------------
class Negated(Codec):
    """A strategy's own codec: the negated vector (a stand-in for any private format)."""

    name = "test-negated"

    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        return ArrayRecord({"minus": numpy_to_array((-vector).numpy())})

    def decode(self, arrays: ArrayRecord, options: Options) -> torch.Tensor:
        layout = require(options.layout, "needs a layout")
        minus = read(arrays, "minus")
        if minus.shape != (layout.numel,):
            raise CodecError("wrong size")
        return -torch.from_numpy(minus.copy())


def test_registered_codec_decodes_through_decode_and_composes(vector):
    if "test-negated" not in codec_names():
        register_codec(Negated())
    with pytest.raises(ValueError, match="already registered"):
        register_codec(Negated())
    assert {"dense", "masked", "sparse", "topk", "grouped", "lowrank", "q8", "f16"} <= set(
        codec_names()
    )
    payload = encode(vector, "test-negated")
    assert measured(payload) == Traffic(D * 4, 0)
    assert torch.equal(decode(content(payload), LAYOUT), vector)
    quantised = decode(content(encode(vector, "test-negated+q8")), LAYOUT)
    assert (quantised - vector).abs().max() <= q8_error_bound(vector)


@pytest.mark.parametrize("name", ["zip", "q8", "dense+zip", "dense+q8+f16", b"dense", None])
def test_unknown_chain_is_rejected_and_counted(vector, name):
    received = RecordDict(
        {
            **encode_dense(vector, LAYOUT),
            "codec": ConfigRecord({} if name is None else {"name": name}),
        }
    )
    with pytest.raises(CodecError, match="unknown codec"):
        decode(received, LAYOUT)
    assert payload_traffic(received) == Traffic(56 * 4 + 8, 0)


# ----- rejections of malformed input ----------------------------------------------------
SPARSE = encode_sparse(torch.arange(float(D)), torch.tensor([1, 4, 9, 16]))


@pytest.mark.parametrize(
    ("arrays", "error"),
    [
        ({"indices": np.array([1, 4, 9, 16], np.int64)}, "int64, not int32"),
        ({"indices": np.array([1, 4, 9, 57], np.int32)}, "out of range"),
        ({"indices": np.array([-1, 4, 9, 16], np.int32)}, "out of range"),
        ({"indices": np.array([1, 4, 4, 16], np.int32)}, "index 4 duplicated"),
        ({"indices": np.array([1, 9, 4, 16], np.int32)}, "not strictly increasing"),
        ({"indices": np.array([[1, 4, 9, 16]], np.int32)}, "not 1-D"),
        ({"values": np.ones(4, np.float64)}, "float64 of shape"),
        ({"values": np.ones((2, 2), np.float32)}, r"shape \(2, 2\), not float32 1-D"),
        ({"values": np.ones(3, np.float32)}, "3 values for 4"),
        ({"indices": None}, "no array 'indices'"),
        ({"values": None}, "no array 'values'"),
    ],
)
def test_sparse_rejects(arrays, error, base):
    with pytest.raises(CodecError, match=error):
        decode(tampered(SPARSE, **arrays), LAYOUT, base=base)


def test_sparse_needs_the_receivers_base():
    with pytest.raises(CodecError, match="base vector"):
        decode(content(SPARSE), LAYOUT)
    with pytest.raises(CodecError, match="base has 3 scalars"):
        decode(content(SPARSE), LAYOUT, base=torch.zeros(3))


Q8 = encode(torch.arange(float(D)), "masked+q8", mask=torch.arange(D) < 5)
HELD = torch.arange(D) < 5


@pytest.mark.parametrize(
    ("arrays", "error"),
    [
        ({"values:scale": np.array(np.nan, np.float32)}, "nan, not finite"),
        ({"values:scale": np.array(np.inf, np.float32)}, "inf, not finite"),
        ({"values:scale": np.array(-1.0, np.float32)}, "not finite and non-negative"),
        ({"values:scale": np.array([0.5], np.float32)}, r"float32 \(1,\), not float32 \(\)"),
        ({"values:scale": np.array(0.5, np.float64)}, "float64"),
        ({"values:scale": None}, "no array 'values:scale'"),
        ({"values": np.ones(5, np.int16)}, "int16, not int8"),
        ({"values": np.ones(6, np.int8)}, "6 values for 5"),
    ],
)
def test_q8_rejects(arrays, error, base):
    with pytest.raises(CodecError, match=error):
        decode(tampered(Q8, **arrays), LAYOUT, base=base, mask=HELD)


def test_f16_rejects_other_dtypes(vector, base):
    payload = encode(vector, "masked+f16", mask=HELD)
    with pytest.raises(CodecError, match="float32, not float16"):
        decode(tampered(payload, values=np.ones(5, np.float32)), LAYOUT, base=base, mask=HELD)


def test_masked_rejects_bad_bitmap_and_wrong_mask(vector, base):
    shipped = encode_masked(vector, HELD, ship_mask=True)
    with pytest.raises(CodecError, match="bitmap of 2 bytes cannot hold 57"):
        decode(tampered(shipped, mask=np.zeros(2, np.uint8)), LAYOUT, base=base)
    held = encode_masked(vector, HELD, ship_mask=False)
    with pytest.raises(CodecError, match="not bool like base"):
        decode(content(held), LAYOUT, base=base, mask=HELD.int())


def test_masked_under_a_stage_scales_each_tensor_alone():
    # w moves by ~100, b by ~0.01: one scale for both rounds every b value to 0 at 4 bits
    vector = torch.cat(
        [torch.linspace(-100, 100, 48), torch.linspace(0.01, 0.08, 8), torch.ones(1)]
    )
    mask = torch.ones(D, dtype=torch.bool)
    mask[:8] = False
    one_scale = decode(
        content(encode(vector, "masked+q4", mask=mask)), LAYOUT, base=torch.zeros(D), mask=mask
    )
    assert one_scale[48:56].abs().max() == 0
    payload = encode(vector, "masked+q4", mask=mask, layout=LAYOUT)
    assert sorted(payload["arrays"]) == sorted(
        f"values.{i}{part}" for i in range(3) for part in ("", ":scale", ":shape")
    )
    decoded = decode(content(payload), LAYOUT, base=torch.zeros(D), mask=mask)
    assert decoded[48:56].tolist() == pytest.approx(
        vector[48:56].tolist(), abs=0.08 / 7 / 2 * 1.001
    )
    assert decoded[:8].tolist() == [0.0] * 8  # not sent: the base
    # bytes: per tensor its packed codes, a float32 scale and an int64 shape (40, 8, 1 values)
    assert measured(payload) == Traffic((20 + 4 + 8) + (4 + 4 + 8) + (1 + 4 + 8))
    # unstaged, the values' bytes do not depend on the split
    split = encode(vector, "masked", mask=mask, layout=LAYOUT)
    assert measured(split) == measured(encode_masked(vector, mask, ship_mask=False))
    assert torch.equal(
        decode(content(split), LAYOUT, base=torch.zeros(D), mask=mask), vector * mask
    )


@pytest.mark.parametrize(
    ("arrays", "error"),
    [
        ({"values.3": np.ones(1, np.float32)}, r"extra arrays \['values.3'\]"),
        (
            {"values": np.ones(5, np.float32)},
            r"extra arrays \['values.0', 'values.1', 'values.2'\]",
        ),
        ({"values.1": np.ones(3, np.float32)}, "3 values for 8"),
        ({"values.0": None}, "no array 'values.0'"),
    ],
)
def test_masked_per_tensor_rejects(arrays, error, vector, base):
    payload = encode(vector, "masked", mask=torch.ones(D, dtype=torch.bool), layout=LAYOUT)
    with pytest.raises(CodecError, match=error):
        decode(tampered(payload, **arrays), LAYOUT, base=base, mask=torch.ones(D, dtype=torch.bool))


def test_grouped_rejects(vector):
    keys = torch.tensor([0, 1, 1] * 19)
    payload = encode_grouped(vector, keys)
    with pytest.raises(CodecError, match=r"missing arrays \['g1'\], extra \[\]"):
        decode(tampered(payload, g1=None), LAYOUT, groups=keys)
    with pytest.raises(CodecError, match=r"missing arrays \[\], extra \['g7'\]"):
        decode(tampered(payload, g7=np.ones(1, np.float32)), LAYOUT, groups=keys)
    with pytest.raises(CodecError, match="20 values for 19"):
        decode(tampered(payload, g0=np.ones(20, np.float32)), LAYOUT, groups=keys)
    with pytest.raises(CodecError, match="group keys"):
        decode(content(payload), LAYOUT, groups=keys[:-1])
    with pytest.raises(CodecError, match="group keys"):
        decode(content(payload), LAYOUT)


def test_lowrank_rejects(vector):
    payload = encode_lowrank(vector, LAYOUT, rank=2)
    with pytest.raises(CodecError, match=r"not \(6, r\) and \(r, 8\)"):
        decode(tampered(payload, **{"w:U": np.ones((6, 3), np.float32)}), LAYOUT)
    with pytest.raises(CodecError, match="float64 and float32, not float32"):
        decode(tampered(payload, **{"w:U": np.ones((6, 2), np.float64)}), LAYOUT)
    with pytest.raises(CodecError, match="no array 'w:V'"):
        decode(tampered(payload, **{"w:V": None}), LAYOUT)
    with pytest.raises(CodecError, match=r"extra arrays \['w:U', 'w:V'\]"):
        decode(tampered(payload, w=np.ones((6, 8), np.float32)), LAYOUT)
    with pytest.raises(CodecError, match="b is float64"):
        decode(tampered(payload, b=np.ones(8, np.float64)), LAYOUT)


def test_corrupt_array_bytes_are_a_codec_error_and_still_counted(vector, base):
    received = tampered(SPARSE)
    received["arrays"]["values"] = Array("float32", (4,), "numpy.ndarray", b"\x93NUMPY junk")
    with pytest.raises(CodecError, match="array 'values'"):
        decode(received, LAYOUT, base=base)
    assert payload_traffic(received) == Traffic(11, 16)


def test_encoder_refuses_bad_arguments(vector, base):
    with pytest.raises(CodecError, match="not strictly increasing"):
        encode_sparse(vector, torch.tensor([3, 1]))
    with pytest.raises(CodecError, match="k or a fraction"):
        encode_topk(vector, base, k=2, fraction=0.5)
    with pytest.raises(CodecError, match="fraction"):
        encode_topk(vector, base, fraction=1.5)
    with pytest.raises(CodecError, match="rank 0 is not positive"):
        encode_lowrank(vector, LAYOUT, rank=0)
    with pytest.raises(CodecError, match="masked needs a mask"):
        encode(vector, "masked")
