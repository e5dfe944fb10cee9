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

from fl.records import Layout, arrays_to_vector, vector_to_arrays

__all__ = [
    "CodecError",
    "Traffic",
    "decode",
    "encode_dense",
    "encode_masked",
    "payload_traffic",
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
    arrays = ArrayRecord({"values": values})
    control = 0
    if ship_mask:
        bits = np.packbits(mask.numpy().astype(np.uint8))
        arrays["mask"] = Array(bits)
        control = int(bits.nbytes)
    traffic = Traffic(4 * int(values.numel()), control)
    return {ARRAYS: arrays, CODEC: _codec_record("masked", traffic)}


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
            bits = arrays["mask"].numpy()
            mask = torch.from_numpy(np.unpackbits(bits)[: layout.numel].astype(bool))
        if mask is None:
            raise CodecError("masked payload carries no mask and the receiver has none")
        values = torch.from_numpy(arrays["values"].numpy()).reshape(-1).float()
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
