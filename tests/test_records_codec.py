"""Flat-vector layouts and payload codecs: round trips and byte accounting."""

import pytest
import torch
from flwr.app import RecordDict

from fl.codec import CodecError, Traffic, decode, encode_dense, encode_masked, payload_traffic
from fl.records import Layout


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
