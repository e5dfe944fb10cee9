"""Control arrays on the wire, deflated (zlib) when that makes them smaller.

Control state (mask bitmaps, changed-position bitmaps, indices, period values) is
repetitive: a bitmap of a few changes, or periods that mostly share a value, shrinks
several-fold under DEFLATE. `pack` keeps each array as it is or as its zlib stream,
whichever holds fewer bytes (counted by the receiver like any array); `unpack` reads
either, and refuses a stream that inflates past what the receiver expects.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from fl.wire.codec import CodecError
from fl.wire.records import array_to_numpy, numpy_to_array

__all__ = ["pack", "packed_bytes", "unpack"]

DEFLATED = ".z"  # suffix of an array that holds a zlib stream
LEVEL = 6


def _deflate(value: np.ndarray) -> np.ndarray | None:
    """The zlib stream of `value`'s bytes, when it is shorter than they are."""
    data = zlib.compress(value.tobytes(), LEVEL)
    return np.frombuffer(data, dtype=np.uint8) if len(data) < value.nbytes else None


def pack(parts: Mapping[str, np.ndarray]) -> dict[str, Array]:
    """Each part as an Array named by its key, or by key + '.z' when deflated is smaller."""
    out = {}
    for key, value in parts.items():
        deflated = _deflate(value)
        if deflated is None:
            out[key] = numpy_to_array(np.ascontiguousarray(value))
        else:
            out[key + DEFLATED] = numpy_to_array(deflated)
    return out


def packed_bytes(arrays: Mapping[str, Array]) -> int:
    """Bytes these arrays put on the link (what the receiver will count)."""
    return sum(int(array_to_numpy(a).nbytes) for a in arrays.values())


def unpack(arrays: ArrayRecord, key: str, dtype: np.dtype, max_count: int) -> np.ndarray:
    """The 1-D `dtype` array sent under `key` (plain or deflated); CodecError when missing,
    of another dtype, or longer than `max_count` (a deflated stream may not inflate past it)."""
    if key in arrays:
        value = array_to_numpy(arrays[key])
        if value.dtype != dtype or value.ndim != 1 or value.size > max_count:
            raise CodecError(
                f"{key}: {value.dtype} {value.shape}, expected {dtype} of <= {max_count}"
            )
        return value
    if key + DEFLATED not in arrays:
        raise CodecError(f"control array {key!r} is missing")
    stream = array_to_numpy(arrays[key + DEFLATED])
    if stream.dtype != np.uint8 or stream.ndim != 1:
        raise CodecError(f"{key}: a deflated array must be uint8 bytes")
    limit = max_count * dtype.itemsize
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(stream.tobytes(), limit)
    except zlib.error as err:
        raise CodecError(f"{key}: not a zlib stream: {err}") from err
    if inflater.unconsumed_tail or not inflater.eof:
        raise CodecError(f"{key}: inflates past {limit} bytes or is truncated")
    if len(data) % dtype.itemsize:
        raise CodecError(f"{key}: {len(data)} bytes are not whole {dtype} values")
    return np.frombuffer(data, dtype=dtype)
