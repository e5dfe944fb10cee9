"""Fuzzing the server's decode-and-validate path with generated client replies.

Every generated reply is either good (and must then be aggregated, exactly) or broken
in one known way: NaN/Inf, wrong shape or dtype, missing or extra keys, an absurd
norm, an oversized payload, corrupt array bytes, a bogus codec record or metrics. The
properties: nothing raises, each reply is counted once (accepted, rejected with a
reason, or failed), the new global model is the weighted mean of exactly the good
replies, and when nothing is good the global model is untouched.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fl.mechanisms.robust import ExampleBounds
from fl.run.engines.local import LocalGrid
from fl.strategy.server import ServerStrategy
from fl.wire.codec import bitmap, encode_dense, encode_masked, payload_traffic
from fl.wire.records import Layout, array_to_numpy, arrays_to_vector, numpy_to_array
from strategies.fedavg import FedAvgParams

GLOBAL = {
    "w": torch.linspace(-1, 1, 12).reshape(3, 4),
    "b": torch.zeros(4),
    "steps": torch.tensor(7, dtype=torch.int64),  # an integer buffer, like BatchNorm's counter
}
LAYOUT = Layout.of(GLOBAL)
MAX_NORM = 1e3
MAX_PAYLOAD = 64 * 2**10  # an explicit bound keeps generated oversized replies small
FAULTS = (
    "good",
    "good-masked",
    "good-flower",
    "nonfinite",
    "norm",
    "missing-key",
    "extra-key",
    "shape",
    "dtype",
    "bytes",
    "oversize",
    "metrics",
    "codec",
    "no-arrays",
    "error",
)
NP_DTYPES = (
    "float16",
    "float32",
    "float64",
    "int8",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
)


def _grid() -> LocalGrid:
    return LocalGrid(None, 6, {})  # type: ignore[arg-type]  # nodes are never called


def _instruction(strategy: ServerStrategy, grid: Grid) -> list[Message]:
    config = ConfigRecord()
    return list(strategy.configure_train(1, ArrayRecord(GLOBAL), config, grid))


finite = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def good_vector(draw: st.DrawFn) -> torch.Tensor:
    values = draw(st.lists(finite, min_size=LAYOUT.numel, max_size=LAYOUT.numel))
    return torch.tensor(values, dtype=torch.float32)


@st.composite
def bad_array(draw: st.DrawFn, like: Array) -> Array:
    """An Array whose bytes or metadata are corrupt."""
    data = like.data
    kind = draw(
        st.sampled_from(["random", "truncated", "magic", "header", "fortran", "stype", "meta"])
    )
    if kind == "random":
        return Array(like.dtype, like.shape, like.stype, draw(st.binary(max_size=200)))
    if kind == "truncated":
        cut = draw(st.integers(0, max(len(data) - 1, 0)))
        return Array(like.dtype, like.shape, like.stype, data[:cut])
    if kind == "magic":  # a .npy magic string and little else
        tail = draw(st.binary(max_size=6))
        return Array(like.dtype, like.shape, like.stype, b"\x93NUMPY" + tail)
    if kind == "header":  # a valid .npy of another dtype or shape than the Array declares
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        dtype = draw(st.sampled_from(NP_DTYPES))
        if (dtype, shape) == (like.dtype, tuple(like.shape)):
            shape = (*shape, 2)
        value = np.zeros(shape, dtype=dtype)
        return Array(like.dtype, like.shape, like.stype, numpy_to_array(value).data)
    if kind == "fortran":  # a Fortran-ordered .npy (parsed by NumPy's reader) of another dtype
        dtype = draw(st.sampled_from([d for d in NP_DTYPES if d != like.dtype]))
        buffer = io.BytesIO()
        np.save(buffer, np.asfortranarray(np.ones((3, 4), dtype=dtype)))
        return Array(like.dtype, like.shape, like.stype, buffer.getvalue())
    if kind == "stype":
        return Array(like.dtype, like.shape, draw(st.sampled_from(["torch", "", "x"])), data)
    dtype = draw(st.sampled_from(["float64", "float16", "int8", "foo", "<U3", "object", "V4"]))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    return Array(dtype, shape, like.stype, data)


def _metrics(num_examples: int) -> MetricRecord:
    return MetricRecord({"num-examples": num_examples, "train-loss": 0.5})


@st.composite
def reply(
    draw: st.DrawFn, fault: str | None = None
) -> tuple[str, dict[str, Any] | None, torch.Tensor | None, int]:
    """(fault, content or None for an error reply, the decoded vector if good, weight)."""
    fault = fault or draw(st.sampled_from(FAULTS))
    vector = draw(good_vector())
    weight = draw(st.integers(1, 1000))
    records: dict[str, Any] = dict(encode_dense(vector, LAYOUT))
    metrics = _metrics(weight)
    expected: torch.Tensor | None = None
    if fault == "good":
        expected = arrays_to_vector(records["arrays"], LAYOUT)  # "steps" is an integer
    elif fault == "good-flower":  # a plain Flower client: torch tensors, np.save, no codec
        state = LAYOUT.unflatten(vector)
        records = {"arrays": ArrayRecord({k: t.clone() for k, t in state.items()})}
        expected = LAYOUT.flatten(state)
    elif fault == "good-masked":
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=17, max_size=17)))
        records = dict(encode_masked(vector, mask, ship_mask=True))
        expected = LAYOUT.flatten(GLOBAL).clone()
        expected[mask] = vector[mask]
    elif fault == "nonfinite":
        bad = vector.clone()
        bad[draw(st.integers(0, LAYOUT.numel - 2))] = draw(
            st.sampled_from([math.nan, math.inf, -math.inf])
        )
        records = dict(encode_dense(bad, LAYOUT))
    elif fault == "norm":
        records = dict(encode_dense(vector + draw(st.floats(1e3, 1e15)), LAYOUT))
    else:
        arrays = dict(records["arrays"])
        name = draw(st.sampled_from(list(LAYOUT.names)))
        if fault == "missing-key":
            del arrays[name]
        elif fault == "extra-key":
            extra = draw(
                st.text("abcxyz.", min_size=1, max_size=6).filter(lambda s: s not in GLOBAL)
            )
            arrays[extra] = numpy_to_array(np.zeros(draw(st.integers(0, 4)), dtype=np.float32))
        elif fault == "shape":
            shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
            if shape == LAYOUT.shapes[LAYOUT.names.index(name)]:
                shape = (*shape, 2)
            value = np.zeros(shape, dtype=arrays[name].dtype)
            arrays[name] = numpy_to_array(value)
        elif fault == "dtype":
            current = arrays[name].dtype
            dtype = draw(st.sampled_from([d for d in NP_DTYPES if d != current]))
            shape = LAYOUT.shapes[LAYOUT.names.index(name)]
            arrays[name] = numpy_to_array(np.ones(shape, dtype=dtype))
        elif fault == "bytes":
            arrays[name] = draw(bad_array(arrays[name]))
        elif fault == "oversize":  # a valid payload plus a record the decoder would ignore
            junk = np.zeros(draw(st.integers(MAX_PAYLOAD, 2 * MAX_PAYLOAD)), dtype=np.uint8)
            records["padding"] = ArrayRecord({"junk": numpy_to_array(junk)})
        elif fault == "metrics":
            metrics = draw(
                st.sampled_from(
                    [
                        None,
                        MetricRecord({"train-loss": 0.5}),
                        MetricRecord({"num-examples": 0}),
                        MetricRecord({"num-examples": -3}),
                        MetricRecord({"num-examples": 2.5}),
                        MetricRecord({"num-examples": [1, 2]}),
                        MetricRecord({"num-examples": 4, "train-loss": [0.1, 0.2]}),
                    ]
                )
            )
        elif fault == "codec":
            codec = draw(
                st.sampled_from(
                    [
                        {"name": "zip"},
                        {"name": "masked", "payload-bytes": 4, "control-bytes": 0},
                        {"name": "dense", "payload-bytes": -1, "control-bytes": 0},
                        {"name": "dense", "payload-bytes": "many", "control-bytes": 0},
                        {"name": "dense"},
                        {"name": b"dense", "payload-bytes": 68, "control-bytes": 0},
                    ]
                )
            )
            records["codec"] = ConfigRecord(codec)
            if codec["name"] == "masked":  # values for 5 scalars, mask says otherwise
                arrays = {
                    "values": numpy_to_array(np.ones(5, dtype=np.float32)),
                    "mask": bitmap(torch.ones(LAYOUT.numel, dtype=torch.bool)),
                }
        elif fault == "no-arrays":
            del records["arrays"]
            arrays = {}
            if draw(st.booleans()):
                records["arrays"] = ConfigRecord({"w": 1.0})
        if arrays:
            records["arrays"] = ArrayRecord(arrays)
    if fault == "error":
        return fault, None, None, weight
    if metrics is not None:
        records["metrics"] = metrics
    return fault, records, expected, weight


def _check_round(
    generated: list[tuple[str, Any, Any, int]],
    strategy: ServerStrategy,
    bounds: list[int] | None = None,
) -> None:
    """One round of `generated` replies; with `bounds` (per reply, the round loop's partition
    sizes) each good reply must weigh min(claim, bound)."""
    grid = _grid()
    instructions = _instruction(strategy, grid)
    before = strategy.global_vector.clone()
    if bounds is not None:
        nodes = [m.metadata.dst_node_id for m in instructions]
        strategy.bound_examples(ExampleBounds(dict(zip(nodes, bounds, strict=False))))
        generated = [
            (f, c, v, min(w, b)) for (f, c, v, w), b in zip(generated, bounds, strict=False)
        ]
    replies = []
    for (_, content, _, _), instruction in zip(generated, instructions, strict=False):
        if content is None:
            replies.append(Message(Error(3, "client exploded"), reply_to=instruction))
        else:
            replies.append(Message(RecordDict(content), reply_to=instruction))
    # the round loop counts every reply's bytes, rejected or not: this must never raise
    for r in replies:
        if r.has_content():
            traffic = payload_traffic(r.content)
            assert traffic.payload >= 0 and traffic.control >= 0
    arrays, metrics = strategy.aggregate_train(1, replies)
    stats = strategy.stats
    used = generated[: len(replies)]
    good = [(v, w) for _, _, v, w in used if v is not None]
    errors = sum(1 for f, *_ in used if f == "error")
    assert stats.failed == errors
    assert stats.accepted == len(good), (stats.reasons, [f for f, *_ in used])
    assert stats.rejected == len(used) - len(good) - errors
    assert len(stats.reasons) == stats.rejected and all(stats.reasons)
    if not good:
        assert arrays is None and metrics is None
        assert torch.equal(strategy.global_vector, before)
        return
    assert arrays is not None and metrics is not None
    weights = torch.tensor([w for _, w in good], dtype=torch.float64)
    stacked = torch.stack([v for v, _ in good]).double()
    expected = ((weights / weights.sum()) @ stacked).float()
    got = LAYOUT.flatten(arrays.to_torch_state_dict())
    assert torch.isfinite(got).all()
    assert torch.allclose(got, LAYOUT.flatten(LAYOUT.unflatten(expected)), atol=1e-5)
    assert metrics["num-examples"] == int(weights.sum())


def _fuzz(generated: list[tuple[str, Any, Any, int]]) -> None:
    strategy = ServerStrategy(
        FedAvgParams(),
        seed=0,
        clients_per_round=len(generated),
        max_update_norm=MAX_NORM,
        max_payload_bytes=MAX_PAYLOAD,
    )
    _check_round(generated, strategy)


replies = st.lists(reply(), min_size=1, max_size=4)
QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]


@settings(max_examples=400, deadline=None, suppress_health_check=QUIET)
@given(replies)
def test_generated_replies_never_crash_or_corrupt_the_model(generated):
    _fuzz(generated)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=QUIET)
@given(replies)
def test_ten_thousand_generated_replies(generated):
    _fuzz(generated)


@settings(max_examples=100, deadline=None, suppress_health_check=QUIET)
@given(data=st.data())
def test_no_claimed_example_count_weighs_more_than_the_servers_bound(data):
    """Claims up to 10^12 examples, bounds of 1-1000: the mean uses min(claim, bound)."""
    generated = data.draw(replies)
    claims = []
    for fault, content, expected, weight in generated:
        if content is not None and fault.startswith("good"):
            weight = data.draw(st.one_of(st.integers(1, 1000), st.just(10**12)))
            content = {**content, "metrics": _metrics(weight)}
        claims.append((fault, content, expected, weight))
    bounds = data.draw(st.lists(st.integers(1, 1000), min_size=4, max_size=4))
    strategy = ServerStrategy(
        FedAvgParams(),
        seed=0,
        clients_per_round=len(claims),
        max_update_norm=MAX_NORM,
        max_payload_bytes=MAX_PAYLOAD,
    )
    _check_round(claims, strategy, bounds)
    over = sum(
        1
        for (f, c, _, w), b in zip(claims, bounds, strict=False)
        if c is not None and f.startswith("good") and w > b
    )
    assert strategy.stats.examples_clipped == over


@pytest.mark.parametrize(
    "value",
    [
        np.array(7, dtype=np.int64),  # 0-d
        np.zeros((0, 3), np.float32),  # empty
        np.arange(12, dtype=np.float16).reshape(3, 4),
        np.array([True, False, True]),
        np.arange(20.0).reshape(4, 5).T,  # not C-ordered: written C-ordered
    ],
)
def test_arrays_we_write_hold_what_np_save_writes(value):
    buffer = io.BytesIO()
    np.save(buffer, value.copy(order="C"), allow_pickle=False)
    assert numpy_to_array(value).data == buffer.getvalue()
    assert np.array_equal(array_to_numpy(numpy_to_array(value)), value)


def test_a_fortran_ordered_npy_from_another_writer_decodes_to_the_same_values():
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    buffer = io.BytesIO()
    np.save(buffer, np.asfortranarray(value))
    array = Array("float32", (3, 4), "numpy.ndarray", buffer.getvalue())
    assert np.array_equal(array_to_numpy(array), value)
    with pytest.raises(ValueError, match="declares"):
        array_to_numpy(Array("float64", (3, 4), "numpy.ndarray", buffer.getvalue()))


@pytest.mark.parametrize("fault", [f for f in FAULTS if not f.startswith("good") and f != "error"])
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[*QUIET, HealthCheck.function_scoped_fixture],  # caplog.clear()
)
@given(data=st.data())
def test_every_fault_kind_is_rejected_with_a_reason(fault, data, caplog):
    example = data.draw(reply(fault))
    caplog.clear()
    strategy = ServerStrategy(
        FedAvgParams(),
        seed=0,
        clients_per_round=1,
        max_update_norm=MAX_NORM,
        max_payload_bytes=MAX_PAYLOAD,
    )
    with caplog.at_level("WARNING", logger="fl.strategy.server"):
        _check_round([example], strategy)
    assert strategy.stats.rejected == 1
    assert "rejected reply of node" in caplog.text
    assert strategy.diagnostics()["rejected"] == 1


def test_the_default_payload_bound_is_four_dense_models_plus_a_mebibyte(caplog):
    strategy = ServerStrategy(FedAvgParams(), seed=0, clients_per_round=1)
    instruction = _instruction(strategy, _grid())[0]
    dense = 16 * 4 + 8  # 16 float32 scalars and one int64
    assert strategy.payload_limit() == 4 * dense + 2**20
    records = dict(encode_dense(LAYOUT.flatten(GLOBAL), LAYOUT))
    junk = np.zeros(2**20, dtype=np.uint8)
    records["padding"] = ArrayRecord({"junk": numpy_to_array(junk)})
    records["metrics"] = _metrics(5)
    reply = Message(RecordDict(records), reply_to=instruction)
    assert strategy.aggregate_train(1, [reply]) == (None, None)
    assert "exceeds max_payload_bytes" in strategy.stats.reasons[0]
