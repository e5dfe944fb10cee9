"""The example-weighted mean of client vectors, summed in float64 a block at a time.

`weighted_mean` (fl.mechanisms.robust) stacks every reply and converts the stack to float64: for
ten ResNet-18 replies that is about 0.9 GB of temporaries. Here each block of
coordinates (small enough to stay in cache) is summed over the replies in float64 and
written out as float32, so the temporaries are one or two blocks, each reply is read
once, and nothing is stacked. The sum runs reply by reply with a fused multiply-add; the
result is at most one float32 ulp from the reference (both round a float64 sum to
float32), and equal to it where the reference's BLAS fuses too (MKL with AVX-512 does; on
AMD CPUs MKL does not, and the last bit can differ).

Large vectors (ResNet-sized) go through one compiled call for the whole model
(`fl.wire.mean_kernel`: Numba, four replies a pass over an L1-sized block); small ones stay
on torch, so runs with small models never pay Numba's start-up (~0.3 s import, ~1 s to
compile once per machine, cached after). Both paths give identical bits: the kernel's
spelled-out fused multiply-add is the one torch's vectorised add uses.

Records in, record out (`streamed_record_mean`, what Flower's `aggregate_arrayrecords`
does): a large float32 model's replies are read in place from their records' buffers
(checked as `arrays_to_vector` checks them) and never decoded into copies, and the kernel
writes the mean straight into the `bytes` each output Array will hold (made blank through
CPython's `PyBytes_FromStringAndSize(NULL, n)` and filled before anything else can see
them, the one case in which the C API allows writing a bytes object), so each reply's
bytes are read once and the mean's written once. Every coordinate sums the same products
in the same order as `streamed_weighted_mean` of the decoded vectors: the same bits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord

from fl.wire.records import (
    Layout,
    array_record,
    arrays_to_vector,
    dense_views,
    npy_array,
    vector_to_arrays,
)

__all__ = ["BLOCK", "COMPILED_MIN", "streamed_record_mean", "streamed_weighted_mean"]

BLOCK = 65_536  # coordinates per block: two float64 blocks (1 MiB) stay in L2
COMPILED_MIN = 1 << 20  # coordinates from which the compiled kernel pays for its start-up


def streamed_weighted_mean(vectors: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Example-weighted mean of equally long 1-D `vectors` (float32 out), in float64."""
    if not vectors:
        raise ValueError("no vectors to average")
    size = vectors[0].numel()
    if any(v.dim() != 1 or v.numel() != size for v in vectors):
        raise ValueError("vectors must be 1-D and of equal length")
    scale = (weights.double() / weights.double().sum()).tolist()
    if size >= COMPILED_MIN and all(_plain_float32(v) for v in vectors):
        arrays = [v.numpy() for v in vectors]  # held: the kernel reads them by address
        out = np.empty(size, dtype=np.float32)
        _compiled_mean(np.array([out.ctypes.data]), [arrays], [size], scale)
        return torch.from_numpy(out)
    return _torch_mean(vectors, scale)


def streamed_record_mean(
    records: Sequence[ArrayRecord], weights: torch.Tensor, layout: Layout
) -> ArrayRecord:
    """Example-weighted mean of dense ArrayRecords (checked against `layout`) as one record."""
    if not records:
        raise ValueError("no records to average")
    if layout.numel < COMPILED_MIN or any(w.dtype != np.float32 for w in layout.wire):
        vectors = [arrays_to_vector(record, layout) for record in records]
        return vector_to_arrays(streamed_weighted_mean(vectors, weights), layout)
    views = [dense_views(record, layout) for record in records]  # every reply checked first
    scale = (weights.double() / weights.double().sum()).tolist()
    blanks = [_blank_bytes(len(w.header) + (w.stop - w.start) * 4) for w in layout.wire]
    outputs = []
    for (_, address), wire in zip(blanks, layout.wire, strict=True):
        ctypes.memmove(address, wire.header, len(wire.header))
        outputs.append(address + len(wire.header))  # the values follow the header
    by_tensor = [[view[t] for view in views] for t in range(len(layout.wire))]
    _compiled_mean(np.array(outputs), by_tensor, [w.stop - w.start for w in layout.wire], scale)
    arrays = {
        w.name: npy_array(w.dtype_name, w.shape, data)
        for (data, _), w in zip(blanks, layout.wire, strict=True)
    }
    return array_record(arrays)


def _plain_float32(vector: torch.Tensor) -> bool:
    """A tensor NumPy can view as is: float32 in CPU memory, contiguous, no autograd."""
    return (
        vector.dtype == torch.float32
        and vector.device.type == "cpu"
        and vector.is_contiguous()
        and not vector.requires_grad
    )


def _torch_mean(vectors: Sequence[torch.Tensor], scale: list[float]) -> torch.Tensor:
    size = vectors[0].numel()
    out = torch.empty(size, dtype=torch.float32)
    acc = torch.empty(min(BLOCK, size), dtype=torch.float64)
    part = torch.empty_like(acc)
    for start in range(0, size, BLOCK):
        stop = min(start + BLOCK, size)
        total, tmp = acc[: stop - start], part[: stop - start]
        total.copy_(vectors[0][start:stop]).mul_(scale[0])
        for factor, vector in zip(scale[1:], vectors[1:], strict=True):
            total.add_(tmp.copy_(vector[start:stop]), alpha=factor)
        out[start:stop].copy_(total)
    return out


def _compiled_mean(
    outputs: np.ndarray, tensors: list[list[np.ndarray]], sizes: list[int], scale: list[float]
) -> None:
    """Write the mean of each `tensors[t]` (one float32 array a reply, `sizes[t]` long) to
    the float32 buffer at address `outputs[t]`, in one compiled call."""
    from fl.wire.mean_kernel import mean_into  # Numba: only models this large pay for it

    for group, size in zip(tensors, sizes, strict=True):  # the kernel trusts these addresses
        if any(a.dtype != np.float32 or a.size != size or not a.flags.c_contiguous for a in group):
            raise ValueError("the compiled mean takes contiguous float32 arrays of equal size")
    inputs = np.array([[a.ctypes.data for a in group] for group in tensors], dtype=np.intp)
    mean_into(outputs.astype(np.intp), inputs, np.array(sizes, dtype=np.intp), np.array(scale))


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype, _bytes_address.argtypes = ctypes.c_void_p, (ctypes.py_object,)


def _blank_bytes(size: int) -> tuple[bytes, int]:
    """A new, unshared `bytes` of `size` unwritten bytes and the address of its first.

    The C API's one sanctioned way to make a bytes object's contents in place: a fresh
    object from `PyBytes_FromStringAndSize(NULL, size)` may be written through
    `PyBytes_AsString` until it is shared. Only our caller holds it, and it writes every
    byte before publishing the object. (Size 0 is CPython's shared empty bytes; a .npy
    payload is never that short.)
    """
    if size < 2:
        raise ValueError(f"a .npy payload of {size} bytes")
    data = _new_bytes(None, size)
    return data, _bytes_address(data)
