"""Flat-vector layouts and payload codecs: round trips and byte accounting."""

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from fl.wire.codec import CodecError, Traffic, decode, encode_dense, encode_masked, payload_traffic
from fl.wire.records import Layout


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(3, 4), "b": torch.randn(3), "steps": torch.tensor(7)}


def test_layout_round_trip_keeps_shapes_and_dtypes(state):
    layout = Layout.of(state)
    vector = layout.flatten(state)
    assert vector.shape == (16,) and layout.numel == 16
    back = layout.unflatten(vector)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name], tensor)


def test_layout_names_the_mismatch(state):
    layout = Layout.of(state)
    with pytest.raises(ValueError, match="w: shape"):
        layout.flatten({**state, "w": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="missing \\['b'\\]"):
        layout.flatten({"w": state["w"], "steps": state["steps"]})


def _trained_copies(bind: bool) -> tuple[torch.nn.Module, Layout]:
    torch.manual_seed(0)  # a conv whose 150 weights leave the next tensor unaligned unpadded
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 6, 5), torch.nn.Flatten(), torch.nn.Linear(6 * 4 * 4, 3)
    )
    layout = Layout.of(model.state_dict())
    if bind:
        layout.bind(model)
    x, y = torch.randn(8, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model, layout


def test_a_bound_model_trains_bit_for_bit_and_moves_in_one_copy():
    bound, layout = _trained_copies(bind=True)
    plain, _ = _trained_copies(bind=False)
    assert torch.equal(layout.read(bound), layout.flatten(plain.state_dict()))
    storage = layout.read(bound)  # a copy: training on does not change it
    for tensor in bound.state_dict().values():
        assert tensor.data_ptr() % 64 == 0  # aligned as torch allocates, so same kernels
    new = torch.randn(layout.numel)
    layout.load_into(bound, new)
    layout.load_into(plain, new)
    assert torch.equal(layout.read(bound), new)
    assert torch.equal(layout.flatten(bound.state_dict()), layout.flatten(plain.state_dict()))
    assert not torch.equal(storage, new)
    with pytest.raises(ValueError, match="vector has 3 scalars"):
        layout.load_into(bound, torch.zeros(3))  # one-copy loading would broadcast it


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m[0].weight, "data", m[0].weight.data.clone()),  # as .to() does
        lambda m: setattr(m[0], "weight", torch.nn.Parameter(m[0].weight.clone())),
        lambda m: m.__setitem__(2, torch.nn.Linear(6 * 4 * 4, 3)),
    ],
    ids=["moved", "new-parameter", "new-submodule"],
)
def test_a_model_whose_tensors_changed_falls_back_to_per_tensor_copies(change):
    model, layout = _trained_copies(bind=True)
    change(model)
    new = torch.randn(layout.numel)
    layout.load_into(model, new)
    assert torch.equal(layout.read(model), new)
    assert torch.equal(layout.flatten(model.state_dict()), new)
    assert torch.equal(model[2].bias, new[-3:])


def test_only_float32_models_are_bound(state):
    module = torch.nn.Module()
    for name, tensor in state.items():
        module.register_buffer(name, tensor.clone())
    layout = Layout.of(module.state_dict())
    layout.bind(module)  # an int64 buffer: left as it is
    assert module.steps.dtype == torch.int64
    vector = torch.arange(16, dtype=torch.float32)
    layout.load_into(module, vector)
    assert torch.equal(layout.read(module), vector) and int(module.steps) == 15


def test_dense_codec_counts_true_dtype_sizes(state):
    layout = Layout.of(state)
    content = RecordDict(encode_dense(layout.flatten(state), layout))
    assert payload_traffic(content) == Traffic(68, 0)  # 15 float32 and one int64 scalar
    assert torch.equal(decode(content, layout), layout.flatten(state))


def test_masked_codec_sends_only_active_scalars_and_fills_from_base(state):
    layout = Layout.of(state)
    vector = layout.flatten(state)
    mask = torch.arange(16) % 3 == 0  # 6 active scalars
    base = torch.full((16,), -1.0)
    shipped = RecordDict(encode_masked(vector, mask, ship_mask=True))
    assert payload_traffic(shipped) == Traffic(24, 2)  # 6 floats + a 16-bit bitmap
    out = decode(shipped, layout, base=base)
    assert torch.equal(out[mask], vector[mask])
    assert torch.all(out[~mask] == -1.0)

    implicit = RecordDict(encode_masked(vector, mask, ship_mask=False))
    assert payload_traffic(implicit) == Traffic(24, 0)
    assert torch.equal(decode(implicit, layout, base=base, mask=mask), out)
    with pytest.raises(CodecError, match="no mask"):
        decode(implicit, layout, base=base)
    with pytest.raises(CodecError, match="6 values for 5"):
        decode(implicit, layout, base=base, mask=mask & (torch.arange(16) > 0))


def test_plain_flower_arrayrecord_is_read_as_dense(state):
    from flwr.app import ArrayRecord

    layout = Layout.of(state)
    content = RecordDict({"arrays": ArrayRecord(state)})
    assert payload_traffic(content).payload == 3 * 4 * 4 + 3 * 4 + 8  # int64 scalar: 8 bytes
    assert torch.equal(decode(content, layout), layout.flatten(state))


def test_dense_records_hold_the_arrays_flowers_own_constructors_build(state):
    """vector_to_arrays fills Flower's Array objects directly (its constructor is half the
    cost of encoding a small model): the result must be what Flower itself would build,
    field for field, object id included, and must survive Flower's protobuf round trip."""
    from flwr.app import Array, ArrayRecord
    from flwr.common.serde import array_record_from_proto, array_record_to_proto

    layout = Layout.of(state)
    record = encode_dense(layout.flatten(state), layout)["arrays"]
    flowers = ArrayRecord({name: Array(tensor.numpy()) for name, tensor in state.items()})
    assert list(record) == list(flowers)
    for name in state:
        assert vars(record[name]) == vars(flowers[name])
        assert record[name].object_id == flowers[name].object_id
    assert array_record_from_proto(array_record_to_proto(record)) == flowers


@pytest.mark.parametrize(
    "kind, items, bad",
    [
        ("ConfigRecord", {"a": 1, "b": [1.0, 2.0], "c": "x", "d": b"y", "e": True}, {"a": None}),
        ("MetricRecord", {"n": 3, "loss": 0.5, "l": [1, 2]}, {"flag": True}),
        ("RecordDict", {"m": "MetricRecord", "c": "ConfigRecord"}, {"m": {"n": 1}}),
    ],
)
def test_new_record_is_flowers_record_with_flowers_checks(kind, items, bad):
    import flwr.app

    from fl.wire.records import new_record

    record_type = getattr(flwr.app, kind)
    if kind == "RecordDict":  # records of records
        items = {k: getattr(flwr.app, v)({"x": 1}) for k, v in items.items()}
    ours, flowers = new_record(record_type, items), record_type(items)
    assert ours == flowers and ours.object_id == flowers.object_id
    assert vars(ours).keys() == vars(flowers).keys()
    with pytest.raises(TypeError):
        record_type(bad)
    with pytest.raises(TypeError):
        new_record(record_type, bad)
    with pytest.raises(TypeError):
        new_record(record_type, {7: next(iter(items.values()))})


@pytest.mark.parametrize("kind", ["ConfigRecord", "MetricRecord"])
def test_new_record_accepts_and_refuses_each_value_as_flower_does(kind):
    # the plain-type shortcut must change no outcome: subclasses (numpy's float64 is a
    # float, bool an int) and look-alikes (numpy's bool_) still meet Flower's own check
    import enum

    import flwr.app

    from fl.wire.records import extended_record, new_record

    class Level(enum.IntEnum):
        LOW = 1

    record_type = getattr(flwr.app, kind)
    values = [1, 1.5, float("nan"), "s", b"b", True, np.float64(2.0), np.int64(3)]
    values += [np.bool_(True), Level.LOW, None, [1, 2], [True], [], object()]
    for value in values:
        try:
            flowers = record_type({"v": value})
        except TypeError:
            with pytest.raises(TypeError):
                new_record(record_type, {"v": value})
            with pytest.raises(TypeError):
                extended_record(record_type(), {"v": value})
            continue
        assert new_record(record_type, {"v": value}) == flowers, value
        assert extended_record(record_type(), {"v": value}) == flowers, value
