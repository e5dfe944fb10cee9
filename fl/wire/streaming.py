"""The example-weighted mean of client vectors, summed in float64 a block at a time.

`weighted_mean` (fl.mechanisms.robust) stacks every reply and converts the stack to float64: for
ten ResNet-18 replies that is about 0.9 GB of temporaries. Here each block of
coordinates (small enough to stay in cache) is summed over the replies in float64 and
written out as float32, so the temporaries are one or two blocks, each reply is read
once, and nothing is stacked. The sum runs reply by reply with a fused multiply-add; the
result is at most one float32 ulp from the reference (both round a float64 sum to
float32), and equal to it where the reference's BLAS fuses too (MKL with AVX-512 does; on
AMD CPUs MKL does not, and the last bit can differ).

Large vectors (ResNet-sized) go through a Numba kernel that converts and accumulates in
one pass (torch needs a conversion kernel and an add kernel per block and reply, ~1.8×
slower); small ones stay on torch, so runs with small models never pay Numba's start-up
(~0.3 s import, ~1 s to compile once per machine, cached after). Both paths give
identical bits: the kernel contracts `acc + a * x` to the same fused multiply-add.

Records in, record out (`streamed_record_mean`, what Flower's `aggregate_arrayrecords`
does): a large float32 model's replies are read in place from their records' buffers
(checked as `arrays_to_vector` checks them) and never decoded into copies, so each reply's
bytes are read once, by the kernel; the mean is written out as one record. Every
coordinate sums the same products in the same order as `streamed_weighted_mean` of the
decoded vectors: the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord

from fl.wire.records import Layout, arrays_to_vector, dense_views, vector_to_arrays

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
        return torch.from_numpy(_compiled_mean([v.numpy() for v in vectors], scale))
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
    out = np.empty(layout.numel, dtype=np.float32)
    for t, wire in enumerate(layout.wire):
        _compiled_mean([v[t] for v in views], scale, out[wire.start : wire.stop])
    return vector_to_arrays(torch.from_numpy(out), layout)


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
    arrays: Sequence[np.ndarray], scale: list[float], out: np.ndarray | None = None
) -> np.ndarray:
    scaled_into, multiply_add = _kernels()
    size = arrays[0].size
    out = np.empty(size, dtype=np.float32) if out is None else out
    acc = np.empty(min(BLOCK, size), dtype=np.float64)
    for start in range(0, size, BLOCK):
        stop = min(start + BLOCK, size)
        total = acc[: stop - start]
        scaled_into(total, arrays[0][start:stop], scale[0])
        for factor, array in zip(scale[1:], arrays[1:], strict=True):
            multiply_add(total, array[start:stop], factor)
        out[start:stop] = total
    return out


@functools.cache
def _kernels() -> tuple[Callable[..., None], Callable[..., None]]:
    """The two Numba kernels, compiled (or loaded from Numba's cache) on first use."""
    import numba

    # "contract" lets LLVM fuse a * x + acc into one FMA, as torch's vectorised add does.
    jit = numba.njit(cache=True, nogil=True, fastmath={"contract"})

    @jit
    def scaled_into(acc: np.ndarray, x: np.ndarray, a: float) -> None:
        for j in range(acc.shape[0]):
            acc[j] = a * np.float64(x[j])

    @jit
    def multiply_add(acc: np.ndarray, x: np.ndarray, a: float) -> None:
        for j in range(acc.shape[0]):
            acc[j] += a * np.float64(x[j])

    return scaled_into, multiply_add
