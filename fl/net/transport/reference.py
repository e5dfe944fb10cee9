"""Reference records: the small stand-in a message carries for arrays sent on the side.

`Packer.pack` turns the large ArrayRecords of a RecordDict into one contiguous blob plus a
ConfigRecord naming what the blob holds (record keys, array names, dtypes, shapes, byte
count, a SHA-256 digest: `fl.net.transport.digest`); `unpack` checks a blob against such a
reference and rebuilds the very same ArrayRecords (same bytes, same Flower object ids).
A reference comes from the other side of a network, so `Reference.parse` validates every
field before anything is allocated: counts, ranks and sizes are bounded, dtypes come
from a whitelist, and the byte count must equal what the shapes and dtypes declare.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fl.net.transport.digest import blob_digest
from fl.wire.records import array_record, array_to_numpy, numpy_to_array

__all__ = [
    "DTYPES",
    "MAX_ARRAYS",
    "MAX_BLOB_BYTES",
    "REFERENCE",
    "Packer",
    "Reference",
    "ReferenceError",
    "blob_sha256",
    "blob_size",
    "unpack",
]

REFERENCE = "bulk-ref"  # the ConfigRecord key a reference travels under
DTYPES = frozenset(
    ["bool", "float16", "float32", "float64", "complex64", "complex128"]
    + [f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)]
)
MAX_ARRAYS = 65_536  # per message: far above any model's tensor count
MAX_RANK = 32  # NumPy's own limit is 64
MAX_BLOB_BYTES = 64 * 2**30  # per message
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ReferenceError(ValueError):
    """A reference record or blob that must not be used."""


def blob_size(value: Any, max_bytes: int = MAX_BLOB_BYTES) -> int:
    """A blob's declared byte count (untrusted), if it is an integer in [0, max_bytes]."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= max_bytes:
        raise ReferenceError(f"nbytes {value!r} is not in [0, {max_bytes}]")
    return value


def blob_sha256(value: Any) -> str:
    """A blob's declared digest (untrusted), if it is 64 lowercase hex digits."""
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ReferenceError("sha256 is not 64 lowercase hex digits")
    return value


@dataclass(frozen=True)
class Reference:
    """What a blob holds: per array its record, name, dtype and shape, in blob order, and
    the order of the message's records (so the rebuilt message is the original)."""

    order: tuple[str, ...]  # keys of the message's records, as they were
    records: tuple[str, ...]  # key of each array's ArrayRecord
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    sha256: str  # fl.net.transport.digest.blob_digest of the blob

    def to_record(self) -> ConfigRecord:
        """The ConfigRecord form (flat lists: ConfigRecords hold no nested values)."""
        return ConfigRecord(
            {
                "order": list(self.order),
                "records": list(self.records),
                "names": list(self.names),
                "dtypes": list(self.dtypes),
                "ranks": [len(s) for s in self.shapes],
                "dims": [d for s in self.shapes for d in s],
                "nbytes": self.nbytes,
                "sha256": self.sha256,
            }
        )

    @classmethod
    def parse(cls, record: ConfigRecord, max_bytes: int = MAX_BLOB_BYTES) -> Reference:
        """Validate an untrusted reference; ReferenceError says what is wrong."""
        order, records, names, dtypes = (
            _strings(record, k) for k in ("order", "records", "names", "dtypes")
        )
        ranks, dims = _ints(record, "ranks"), _ints(record, "dims")
        count = len(names)
        if count > MAX_ARRAYS:
            raise ReferenceError(f"reference lists {count} arrays, more than {MAX_ARRAYS}")
        if not len(records) == len(dtypes) == len(ranks) == count:
            raise ReferenceError("reference lists differ in length")
        bad = sorted(set(dtypes) - DTYPES)
        if bad:
            raise ReferenceError(f"reference dtypes {bad} are not allowed")
        if any(r < 0 or r > MAX_RANK for r in ranks) or sum(ranks) != len(dims):
            raise ReferenceError("reference ranks and dims do not match")
        if any(d < 0 for d in dims):
            raise ReferenceError("reference has a negative dimension")
        shapes, start = [], 0
        for rank in ranks:
            shapes.append(tuple(dims[start : start + rank]))
            start += rank
        nbytes = blob_size(record.get("nbytes"), max_bytes)
        sha = blob_sha256(record.get("sha256"))
        declared = sum(
            math.prod(s) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes, strict=True)
        )
        if declared != nbytes:
            raise ReferenceError(f"reference declares {nbytes} bytes, its arrays hold {declared}")
        if not set(records) <= set(order) or len(set(order)) != len(order):
            raise ReferenceError("reference order does not list each record once")
        if len(set(zip(records, names, strict=True))) != count:
            raise ReferenceError("reference repeats an array name within a record")
        return cls(
            tuple(order), tuple(records), tuple(names), tuple(dtypes), tuple(shapes), nbytes, sha
        )


def _strings(record: ConfigRecord, key: str) -> list[str]:
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ReferenceError(f"reference field {key!r} must be a list of str")
    return [str(v) for v in value]


def _ints(record: ConfigRecord, key: str) -> list[int]:
    value = record.get(key)
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ReferenceError(f"reference field {key!r} must be a list of int")
    return [int(v) for v in value]


def _eligible(record: ArrayRecord) -> list[tuple[str, np.ndarray]] | None:
    """The arrays of a record as C-ordered ndarrays, or None if one cannot travel raw."""
    out = []
    for name, array in record.items():
        try:
            value = array_to_numpy(array)
        except ValueError:
            return None
        if str(value.dtype) not in DTYPES or not value.flags.c_contiguous:
            return None
        out.append((name, value))
    return out


class Packer:
    """Moves the ArrayRecords of at least `min_bytes` out of messages into blobs.

    It remembers the records it packed (kept alive, so their ids stay theirs): the global
    model that goes to every node of a round is copied and hashed once. `forget` drops them.
    """

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = max(min_bytes, 1)
        # (record key, id) of the packed records -> (the records, kept alive; reference; blob)
        self._memo: dict[tuple[tuple[str, int], ...], tuple[list[Any], Reference, Any]] = {}

    def pack(
        self, content: RecordDict, allocate: Callable[[int], Any] = bytearray
    ) -> tuple[RecordDict, Reference, Any] | None:
        """The content that remains, the reference to add to it, and the blob; None when
        no record qualifies. `allocate(nbytes)` gives the blob's writable memory (a
        bytearray; a node's sidecar gives shared memory, so the blob is written once)."""
        moved: dict[str, list[tuple[str, np.ndarray]]] = {}
        for key, record in content.array_records.items():
            arrays = _eligible(record)
            if arrays is not None and sum(v.nbytes for _, v in arrays) >= self.min_bytes:
                moved[key] = arrays
        if not moved:
            return None
        memo_key = tuple((key, id(content[key])) for key in moved)
        if memo_key not in self._memo:
            self._memo[memo_key] = ([content[k] for k in moved], *_blob(moved, allocate))
        _, reference, blob = self._memo[memo_key]
        rest = RecordDict({k: v for k, v in content.items() if k not in moved})
        return rest, replace(reference, order=tuple(content)), blob

    def forget(self) -> None:
        self._memo.clear()


def _blob(
    moved: dict[str, list[tuple[str, np.ndarray]]], allocate: Callable[[int], Any]
) -> tuple[Reference, Any]:
    """One contiguous blob of these arrays, record by record, and its reference."""
    parts = [(key, name, value) for key, arrays in moved.items() for name, value in arrays]
    blob = allocate(sum(v.nbytes for _, _, v in parts))
    target, offset = np.frombuffer(blob, dtype=np.uint8), 0
    for _, _, value in parts:
        target[offset : offset + value.nbytes] = value.reshape(-1).view(np.uint8)
        offset += value.nbytes
    reference = Reference(
        tuple(moved),
        tuple(k for k, _, _ in parts),
        tuple(n for _, n, _ in parts),
        tuple(str(v.dtype) for _, _, v in parts),
        tuple(tuple(v.shape) for _, _, v in parts),
        len(blob),
        blob_digest(blob),
    )
    return reference, blob


def unpack(
    content: RecordDict,
    reference: Reference,
    blob: bytes | bytearray | memoryview,
    *,
    hashed: bool = False,
) -> RecordDict:
    """`content` with the arrays of `blob` back in place of its reference, once the blob
    matches the reference's SHA-256 (`hashed`: the caller already checked it)."""
    if len(blob) != reference.nbytes:
        raise ReferenceError(f"blob has {len(blob)} bytes, the reference {reference.nbytes}")
    if not hashed and blob_digest(blob) != reference.sha256:
        raise ReferenceError("blob does not match the reference's SHA-256")
    kept = set(content) - {REFERENCE}
    if kept | set(reference.records) != set(reference.order) or kept & set(reference.records):
        raise ReferenceError("the message's records are not those the reference lists")
    arrays: dict[str, dict[str, np.ndarray]] = {}
    offset = 0
    for key, name, dtype, shape in zip(
        reference.records, reference.names, reference.dtypes, reference.shapes, strict=True
    ):
        count, kind = math.prod(shape), np.dtype(dtype)
        value = (
            np.frombuffer(blob, dtype=kind, count=count, offset=offset)
            if count
            else np.empty(0, kind)
        )
        arrays.setdefault(key, {})[name] = value.reshape(shape)
        offset += value.nbytes
    restored: Mapping[str, ArrayRecord] = {
        key: array_record({n: numpy_to_array(v) for n, v in values.items()})
        for key, values in arrays.items()
    }
    return RecordDict({k: restored[k] if k in restored else content[k] for k in reference.order})
