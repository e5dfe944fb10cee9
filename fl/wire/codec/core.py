"""The codec registry, the one `encode` and `decode`, and byte accounting.

A codec turns a flat float32 vector into the arrays standing for it; a value stage may
then rewrite each value array (int8 codes and a scale, float16). A chain names both,
"sparse+q8", and travels in the `codec` record, so one `decode` reads every payload.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl.wire.records import (
    Layout,
    array_record,
    array_to_numpy,
    new_record,
    numpy_to_array,
    record_of,
    value_bytes,
)

ARRAYS, CODEC = "arrays", "codec"
Payload = dict[str, ArrayRecord | ConfigRecord]
T = TypeVar("T")


class CodecError(ValueError):
    """A payload that cannot be encoded or decoded: unknown codec, bad sizes, missing records."""


@dataclass(frozen=True)
class Traffic:
    """Bytes of one payload: model values, and control state (masks, indices)."""

    payload: int
    control: int = 0

    @property
    def total(self) -> int:
        """Bytes on the link as implemented (payload plus control state)."""
        return self.payload + self.control

    def __add__(self, other: Traffic) -> Traffic:
        """Bytes of two payloads together."""
        return Traffic(self.payload + other.payload, self.control + other.control)


@dataclass(frozen=True)
class Options:
    """What a codec may need besides the vector: what the receiver holds, and its knobs."""

    layout: Layout | None = None
    base: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    ship_mask: bool = False
    indices: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    fraction: float | None = None
    k: int | None = None
    rank: int | None = None


class Codec(ABC):
    """A first stage: a flat float32 vector to the arrays standing for it, and back.

    `name` is unique and has no '+'. `control` names the arrays of the output that
    are positional metadata (control bytes); every other array holds values (payload).
    `names`: the arrays a payload may hold, when they are fixed; `decode` refuses any other
    (None: the codec checks its own, as dense does against the layout).
    """

    name: str
    control: frozenset[str] = frozenset()
    names: frozenset[str] | None = None

    @abstractmethod
    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        """The arrays standing for `vector`."""

    @abstractmethod
    def decode(self, arrays: ArrayRecord, options: Options) -> torch.Tensor:
        """The flat vector `arrays` stand for; CodecError if they are malformed."""

    def value_dtype(self, name: str, options: Options) -> np.dtype | None:
        """The float dtype array `name` holds values in, or None: what a stage may rewrite."""
        return None if name in self.control else np.dtype(np.float32)


class ValueStage(ABC):
    """A later stage: rewrites each value array, e.g. as int8 codes and a scale.

    `parts` names the arrays it adds beside each value array `X`, sent as `X:part`.
    """

    name: str
    parts: tuple[str, ...] = ()

    @abstractmethod
    def encode(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """'' -> what replaces `values`, and one array per name in `parts`."""

    @abstractmethod
    def decode(self, name: str, parts: Mapping[str, np.ndarray], dtype: np.dtype) -> np.ndarray:
        """The `dtype` values of array `name` that `parts` encode; CodecError if malformed."""


_CODECS: dict[str, Codec] = {}
_STAGES: dict[str, ValueStage] = {}


def register_codec(codec: Codec | ValueStage) -> None:
    """Make `codec` (or a value stage) available to `encode` and `decode` by its name."""
    name = codec.name
    if not name or "+" in name:
        raise ValueError(f"codec name {name!r} must be non-empty, without '+'")
    if name in _CODECS or name in _STAGES:
        raise ValueError(f"codec {name!r} is already registered")
    if isinstance(codec, ValueStage):
        _STAGES[name] = codec
    else:
        _CODECS[name] = codec


def codec_names() -> tuple[str, ...]:
    """Names of the registered codecs and value stages, sorted."""
    return tuple(sorted({*_CODECS, *_STAGES}))


def _chain(name: object) -> tuple[Codec, ValueStage | None]:
    """The codec and optional value stage a chain name ('sparse+q8') stands for."""
    links = name.split("+") if isinstance(name, str) else [""]
    codec, stages = _CODECS.get(links[0]), [_STAGES.get(link) for link in links[1:]]
    if codec is None or len(stages) > 1 or None in stages:
        raise CodecError(
            f"unknown codec {name!r}: expected one of {sorted(_CODECS)},"
            f" optionally '+' one of {sorted(_STAGES)}"
        )
    return codec, stages[0] if stages else None


def require(value: T | None, message: str) -> T:
    """`value`, or CodecError(`message`) when a codec lacks it."""
    if value is None:
        raise CodecError(message)
    return value


def read(arrays: ArrayRecord, name: str) -> np.ndarray:
    """The ndarray of untrusted array `name`; CodecError if missing or malformed."""
    if name not in arrays:
        raise CodecError(f"payload has no array {name!r}")
    try:
        return array_to_numpy(arrays[name])
    except ValueError as err:
        raise CodecError(f"array {name!r}: {err}") from err


def _part(name: str, part: str) -> str:
    return f"{name}:{part}" if part else name


def _staged(stage: ValueStage, codec: Codec, arrays: ArrayRecord, options: Options) -> ArrayRecord:
    """`arrays` with every value array rewritten by `stage`."""
    out = ArrayRecord()
    for name, array in arrays.items():
        if codec.value_dtype(name, options) is None:
            out[name] = array
            continue
        for part, value in stage.encode(array_to_numpy(array)).items():
            out[_part(name, part)] = numpy_to_array(value)
    return out


def _unstaged(
    stage: ValueStage, codec: Codec, arrays: ArrayRecord, options: Options
) -> ArrayRecord:
    """`arrays` with every value array `stage` rewrote restored to the codec's dtype."""
    suffixes = tuple(f":{part}" for part in stage.parts)
    out = array_record(arrays)
    for name in arrays:
        dtype = codec.value_dtype(name, options)
        if dtype is None or name.endswith(suffixes):
            continue
        parts = {part: read(arrays, _part(name, part)) for part in ("", *stage.parts)}
        for part in stage.parts:
            del out[_part(name, part)]
        out[name] = numpy_to_array(stage.decode(name, parts, dtype))
    return out


def _measured(arrays: ArrayRecord, control: Container[str]) -> Traffic:
    """Bytes the arrays hold: those named in `control` are control state, the rest payload."""
    sizes = [(name in control, _held(array)) for name, array in arrays.items()]
    return Traffic(sum(s for c, s in sizes if not c), sum(s for c, s in sizes if c))


def encode(
    vector: torch.Tensor,
    chain: str,
    *,
    layout: Layout | None = None,
    base: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ship_mask: bool = False,
    indices: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    fraction: float | None = None,
    k: int | None = None,
    rank: int | None = None,
) -> Payload:
    """The payload standing for `vector` under `chain` ('dense', 'masked+q8', ...).

    Each codec reads the options it needs and raises CodecError when one is missing.
    """
    codec, stage = _chain(chain)
    options = Options(
        layout=layout,
        base=base,
        mask=mask,
        ship_mask=ship_mask,
        indices=indices,
        groups=groups,
        fraction=fraction,
        k=k,
        rank=rank,
    )
    arrays = codec.encode(vector, options)
    if stage is not None:
        arrays = _staged(stage, codec, arrays, options)
    traffic = _measured(arrays, codec.control)
    record = new_record(
        ConfigRecord,
        {"name": chain, "payload-bytes": traffic.payload, "control-bytes": traffic.control},
    )
    return {ARRAYS: arrays, CODEC: record}


def decode(
    content: RecordDict,
    layout: Layout,
    *,
    base: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full flat vector a payload stands for (dense when it names no codec).

    What the receiver holds completes it: `base` for scalars not sent (masked, sparse,
    top-k), `mask` unless the mask travelled, `groups` for grouped payloads.
    """
    arrays = record_of(content, ARRAYS, ArrayRecord)
    if arrays is None:
        raise CodecError("payload has no 'arrays' record")
    record = record_of(content, CODEC, ConfigRecord)
    codec, stage = _chain(record.get("name") if record is not None else "dense")
    options = Options(layout=layout, base=base, mask=mask, groups=groups)
    if stage is not None:
        arrays = _unstaged(stage, codec, arrays, options)
    if codec.names is not None and (extra := sorted(set(arrays) - codec.names)):
        raise CodecError(f"{codec.name} payload has extra arrays {extra}")
    return codec.decode(arrays, options)


def bitmap(mask: torch.Tensor) -> Array:
    """A boolean mask packed 8 scalars to a byte (d/8 bytes on the link)."""
    return numpy_to_array(np.packbits(mask.numpy().astype(np.uint8)))


def unpack_bitmap(array: Array, numel: int) -> torch.Tensor:
    """The boolean mask of `numel` scalars packed by `bitmap`."""
    try:
        bits = array_to_numpy(array)
    except ValueError as err:
        raise CodecError(f"bitmap: {err}") from err
    if bits.dtype != np.uint8 or bits.size != -(-numel // 8):
        raise CodecError(f"bitmap of {bits.size} bytes cannot hold {numel} scalars")
    return torch.from_numpy(np.unpackbits(bits)[:numel].astype(bool))


def encode_control(arrays: Mapping[str, np.ndarray | torch.Tensor]) -> ArrayRecord:
    """Control state (masks, periods, indices) as a record for `with_control`."""
    return array_record({name: numpy_to_array(_numpy(value)) for name, value in arrays.items()})


def _numpy(value: np.ndarray | torch.Tensor) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def with_control(records: Payload, key: str, control: ArrayRecord) -> Payload:
    """`records` plus `control` (masks, periods, indices) under `key`, counted as control."""
    codec = records[CODEC]
    assert isinstance(codec, ConfigRecord)
    size = sum(_held(array) for array in control.values())
    counted = ConfigRecord({**codec, "control-bytes": cast(int, codec["control-bytes"]) + size})
    return {**records, key: control, CODEC: counted}


def with_control_bitmap(records: Payload, key: str, mask: torch.Tensor) -> Payload:
    """`records` plus a bitmap under `key`, its bytes counted as control traffic."""
    return with_control(records, key, ArrayRecord({"bits": bitmap(mask)}))


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


def declared_traffic(content: RecordDict, held: int | None = None) -> Traffic:
    """The bytes the `codec` record declares; CodecError unless they are plausible.

    Plausible: non-negative integers whose sum does not exceed what the content holds
    (`held`: its `content_bytes`, where the caller has counted them already).
    A check of a reply's consistency only: traffic is measured (`payload_traffic`).
    """
    record = record_of(content, CODEC, ConfigRecord)
    if record is None:
        raise CodecError("payload has no 'codec' record")
    sizes = [record.get("payload-bytes"), record.get("control-bytes")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sizes):
        raise CodecError(f"codec record declares sizes {sizes}, not non-negative integers")
    traffic = Traffic(cast(int, sizes[0]), cast(int, sizes[1]))
    held = content_bytes(content) if held is None else held
    if traffic.total > held:
        raise CodecError(f"codec record declares {traffic.total} B, the payload holds {held} B")
    return traffic


def _held(array: Array) -> int:
    """Bytes of values one Array really holds: its buffer less a .npy header that fits it.

    A buffer that is not the well-formed payload it declares counts whole: bytes received,
    however large the shape it claims.
    """
    try:
        return value_bytes(array)
    except (ValueError, TypeError):
        return len(array.data)


def _control_names(content: RecordDict) -> frozenset[str]:
    """Arrays of the `arrays` record its codec calls positional metadata; never raises."""
    record = record_of(content, CODEC, ConfigRecord)
    try:
        codec, _ = _chain(record.get("name") if record is not None else "dense")
    except CodecError:
        return frozenset()
    return codec.control


def payload_traffic(content: RecordDict) -> Traffic:
    """Bytes a message's arrays put on the link, measured from what it holds.

    Never raises, whatever a client sent, and never trusts a declared size: rejected
    replies count too, at most the bytes that arrived. The `arrays` record's value arrays
    (quantisation scales included) are payload; its positional metadata (a shipped mask,
    sparse indices) and every other array record are control state.
    """
    control = _control_names(content)
    total = Traffic(0)
    for key, arrays in content.items():
        if isinstance(arrays, ArrayRecord):
            total += _measured(arrays, control if key == ARRAYS else arrays.keys())
    return total
