"""Payload codecs with honest byte accounting, shared by every strategy.

An encoded payload is a pair of records in a message: `arrays` (an ArrayRecord) and
`codec` (a ConfigRecord naming the codec and the bytes it puts on the link). Traffic
is counted by the receiver from the arrays that arrived (`payload_traffic`): the bytes
of the values each array really holds (4 B per float32 scalar, 8 B per int64), never a
size a sender declares. The `arrays` record is payload; any other array record (masks,
periods, indices) and a masked payload's shipped bitmap are control state. Framing
(.npy headers, protobuf) is not counted, so every engine reports the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl.records import (
    Layout,
    array_record,
    array_to_numpy,
    arrays_to_vector,
    numpy_to_array,
    vector_to_arrays,
)

__all__ = [
    "CodecError",
    "Traffic",
    "bitmap",
    "content_bytes",
    "declared_traffic",
    "decode",
    "encode_dense",
    "encode_masked",
    "payload_traffic",
    "unpack_bitmap",
    "with_control",
    "with_control_bitmap",
]

ARRAYS, CODEC = "arrays", "codec"


class CodecError(ValueError):
    """A payload that cannot be decoded: unknown codec, wrong sizes, missing records."""


@dataclass(frozen=True)
class Traffic:
    """Bytes of one payload: model values, and control state (masks, indices)."""

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
    arrays = vector_to_arrays(vector, layout)
    traffic = Traffic(sum(_held(a) for a in arrays.values()))
    return {ARRAYS: arrays, CODEC: _codec_record("dense", traffic)}


def encode_masked(
    vector: torch.Tensor, mask: torch.Tensor, *, ship_mask: bool
) -> dict[str, ArrayRecord | ConfigRecord]:
    """Only the scalars where `mask` is True, as one compact vector.

    With `ship_mask` the mask travels too, as a bitmap (d/8 bytes of control state);
    otherwise the receiver must already hold the same mask.
    """
    values = vector[mask].contiguous()
    arrays = array_record({"values": numpy_to_array(values.numpy())})
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
    return with_control(records, key, ArrayRecord({"bits": bitmap(mask)}))


def with_control(
    records: dict[str, ArrayRecord | ConfigRecord], key: str, control: ArrayRecord
) -> dict[str, ArrayRecord | ConfigRecord]:
    """`records` plus `control` (masks, periods, indices) under `key`, counted as control."""
    codec = records[CODEC]
    assert isinstance(codec, ConfigRecord)
    size = sum(array_to_numpy(a).nbytes for a in control.values())
    counted = ConfigRecord({**codec, "control-bytes": cast(int, codec["control-bytes"]) + size})
    return {**records, key: control, CODEC: counted}


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
        raw = array_to_numpy(arrays["values"])
        if raw.dtype != np.float32 or raw.ndim != 1:
            raise CodecError(f"masked values are {raw.dtype} of shape {raw.shape}, not float32 1-D")
        values = torch.from_numpy(raw.copy())
        if values.numel() != int(mask.sum()):
            raise CodecError(f"masked payload has {values.numel()} values for {int(mask.sum())}")
        out = base.clone()
        out[mask] = values
        return out
    raise CodecError(f"unknown codec {name!r}")


def content_bytes(content: RecordDict) -> int:
    """Bytes a message's content actually holds: array data, bytes and strings, numbers."""
    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += sum(len(a.data) for a in record.values())
            continue
        for value in record.values():  # ConfigRecord / MetricRecord: scalars or lists
            for item in value if isinstance(value, list) else [value]:
                total += len(item) if isinstance(item, bytes | str) else 8
    return total


def declared_traffic(content: RecordDict) -> Traffic:
    """The bytes the `codec` record declares; CodecError unless they are plausible.

    Plausible: non-negative integers whose sum does not exceed what the content holds.
    A check of a reply's consistency only: traffic is measured (`payload_traffic`).
    """
    record = content.config_records.get(CODEC)
    if record is None:
        raise CodecError("payload has no 'codec' record")
    sizes = [record.get("payload-bytes"), record.get("control-bytes")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sizes):
        raise CodecError(f"codec record declares sizes {sizes}, not non-negative integers")
    traffic = Traffic(cast(int, sizes[0]), cast(int, sizes[1]))
    held = content_bytes(content)
    if traffic.total > held:
        raise CodecError(f"codec record declares {traffic.total} B, the payload holds {held} B")
    return traffic


def _held(array: Array) -> int:
    """Bytes of values one Array really holds: its buffer less a .npy header that fits it.

    A buffer that is not the well-formed payload it declares counts whole: bytes received,
    however large the shape it claims.
    """
    try:
        return int(array_to_numpy(array).nbytes)
    except (ValueError, TypeError):
        return len(array.data)


def payload_traffic(content: RecordDict) -> Traffic:
    """Bytes a message's arrays put on the link, measured from what it holds.

    Never raises, whatever a client sent, and never trusts a declared size: rejected
    replies count too, at most the bytes that arrived. Payload is the `arrays` record;
    the rest (other array records, a masked payload's shipped `mask`) is control state.
    """
    record = content.config_records.get(CODEC)
    masked = record is not None and record.get("name") == "masked"
    payload = control = 0
    for key, arrays in content.array_records.items():
        for name, array in arrays.items():
            if key == ARRAYS and not (masked and name == "mask"):
                payload += _held(array)
            else:
                control += _held(array)
    return Traffic(payload, control)
