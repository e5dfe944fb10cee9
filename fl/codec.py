"""Payload codecs with honest byte accounting, shared by every strategy.

An encoded payload is a pair of records in a message: `arrays` (an ArrayRecord) and
`codec` (a ConfigRecord naming the codec and the logical bytes it puts on the link).
Logical bytes are what the algorithm says must cross the link (4 B per float32
scalar sent, plus any control state such as a shipped mask), so bytes are counted the
same way for every strategy whatever the engine actually moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl.records import (
    Layout,
    array_to_numpy,
    arrays_to_vector,
    numpy_to_array,
    vector_to_arrays,
)

__all__ = [
    "CodecError",
    "Traffic",
    "bitmap",
    "decode",
    "encode_dense",
    "encode_masked",
    "payload_traffic",
    "unpack_bitmap",
    "with_control_bitmap",
]

ARRAYS, CODEC = "arrays", "codec"


class CodecError(ValueError):
    """A payload that cannot be decoded: unknown codec, wrong sizes, missing records."""


@dataclass(frozen=True)
class Traffic:
    """Logical bytes of one payload: model values, and control state (masks, indices)."""

    payload: int
    control: int = 0

    @property
    def total(self) -> int:
        """Bytes on the link as implemented (payload plus control state)."""
        return self.payload + self.control


def _codec_record(name: str, traffic: Traffic) -> ConfigRecord:
    return ConfigRecord(
        {"name": name, "payload-bytes": traffic.payload, "control-bytes": traffic.control}
    )


def encode_dense(vector: torch.Tensor, layout: Layout) -> dict[str, ArrayRecord | ConfigRecord]:
    """Every scalar as a named tensor: Flower's usual ArrayRecord."""
    traffic = Traffic(4 * layout.numel)
    return {ARRAYS: vector_to_arrays(vector, layout), CODEC: _codec_record("dense", traffic)}


def encode_masked(
    vector: torch.Tensor, mask: torch.Tensor, *, ship_mask: bool
) -> dict[str, ArrayRecord | ConfigRecord]:
    """Only the scalars where `mask` is True, as one compact vector.

    With `ship_mask` the mask travels too, as a bitmap (d/8 bytes of control state);
    otherwise the receiver must already hold the same mask.
    """
    values = vector[mask].contiguous()
    arrays = ArrayRecord({"values": numpy_to_array(values.numpy())})
    control = 0
    if ship_mask:
        arrays["mask"] = bitmap(mask)
        control = len(arrays["mask"].numpy())
    traffic = Traffic(4 * int(values.numel()), control)
    return {ARRAYS: arrays, CODEC: _codec_record("masked", traffic)}


def bitmap(mask: torch.Tensor) -> Array:
    """A boolean mask packed 8 scalars to a byte (d/8 bytes on the link)."""
    return numpy_to_array(np.packbits(mask.numpy().astype(np.uint8)))


def unpack_bitmap(array: Array, numel: int) -> torch.Tensor:
    """The boolean mask of `numel` scalars packed by `bitmap`."""
    bits = array_to_numpy(array)
    if bits.dtype != np.uint8 or bits.size != -(-numel // 8):
        raise CodecError(f"bitmap of {bits.size} bytes cannot hold {numel} scalars")
    return torch.from_numpy(np.unpackbits(bits)[:numel].astype(bool))


def with_control_bitmap(
    records: dict[str, ArrayRecord | ConfigRecord], key: str, mask: torch.Tensor
) -> dict[str, ArrayRecord | ConfigRecord]:
    """`records` plus a bitmap under `key`, its bytes counted as control traffic."""
    array = bitmap(mask)
    codec = records[CODEC]
    assert isinstance(codec, ConfigRecord)
    control = cast(int, codec["control-bytes"]) + len(array_to_numpy(array))
    counted = ConfigRecord({**codec, "control-bytes": control})
    return {**records, key: ArrayRecord({"bits": array}), CODEC: counted}


def decode(
    content: RecordDict,
    layout: Layout,
    *,
    base: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full flat vector a payload stands for.

    Masked payloads need `base` (the values the receiver holds for unsent scalars) and,
    unless the mask travelled with the payload, the receiver's `mask`.
    """
    if ARRAYS not in content.array_records:
        raise CodecError("payload has no 'arrays' record")
    arrays = content.array_records[ARRAYS]
    name = str(content.config_records[CODEC]["name"]) if CODEC in content else "dense"
    if name == "dense":
        try:
            return arrays_to_vector(arrays, layout)
        except (KeyError, ValueError, TypeError) as err:
            raise CodecError(f"dense payload does not fit the model: {err}") from err
    if name == "masked":
        if base is None:
            raise CodecError("masked payload needs the receiver's base vector")
        if "mask" in arrays:
            mask = unpack_bitmap(arrays["mask"], layout.numel)
        if mask is None:
            raise CodecError("masked payload carries no mask and the receiver has none")
        values = torch.from_numpy(array_to_numpy(arrays["values"]).copy()).reshape(-1).float()
        if values.numel() != int(mask.sum()):
            raise CodecError(f"masked payload has {values.numel()} values for {int(mask.sum())}")
        out = base.clone()
        out[mask] = values
        return out
    raise CodecError(f"unknown codec {name!r}")


def payload_traffic(content: RecordDict) -> Traffic:
    """Logical bytes a message's payload puts on the link (0 when it carries no arrays)."""
    if CODEC in content.config_records:
        record = content.config_records[CODEC]
        return Traffic(cast(int, record["payload-bytes"]), cast(int, record["control-bytes"]))
    arrays = content.array_records.get(ARRAYS)
    if arrays is None:
        return Traffic(0)
    return Traffic(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays.values()))
