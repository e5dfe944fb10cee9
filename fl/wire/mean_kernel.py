"""The compiled float64 weighted mean behind `fl.wire.streaming`: one call for a whole model.

Imported only for large models (it imports Numba, ~0.3 s; compiled once per machine and
cached). The kernel reads each tensor of each reply where it already lies (any buffer: a
decoded vector, a Flower Array's bytes) and writes the float32 mean where the caller wants
it, so the replies are never stacked or copied and the output is written once.

Every coordinate gets the same operations in the same order wherever it sits in a block
and however the replies are grouped: `acc = a_0 * x_0`, then `acc = fma(a_r, x_r, acc)` for
r = 1, 2, ... in float64, rounded once to float32. The fused multiply-add is spelled out
(LLVM's `llvm.fma`), not left to the compiler's contraction, so the bits are the code's.
What makes it fast is the traffic: a block of coordinates (`BLOCK`, its float64
accumulator 16 KiB, in L1) takes four replies per pass, so the accumulator is loaded and
stored once per four replies instead of once per reply, and the whole model is one call
(Python called a kernel per block, reply and tensor before: 2,870 calls for ten ResNet-18s).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

__all__ = ["BLOCK", "mean_into"]

BLOCK = 2048  # coordinates per block: the float64 accumulator (16 KiB) stays in L1


@intrinsic
def _float32_at(typingctx, address):
    """The float32 pointer at an integer address (the caller keeps its buffer alive)."""
    sig = types.CPointer(types.float32)(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@intrinsic
def _fma(typingctx, a, x, acc):
    """a * x + acc rounded once: the fused multiply-add torch's vectorised add also uses."""
    sig = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _floats(address, start, count):
    return numba.carray(_float32_at(address + 4 * start), count)


@numba.njit(cache=True, nogil=True)
def mean_into(outputs, inputs, sizes, scale):
    """Write sum_r scale[r] * reply r of tensor t (float64, rounded to float32) to the
    float32 buffer at `outputs[t]`; reply r's tensor t lies at `inputs[t, r]`, `sizes[t]`
    float32 scalars each. The caller checks every buffer's size and keeps it alive."""
    acc = np.empty(BLOCK, np.float64)
    replies = inputs.shape[1]
    for t in range(sizes.shape[0]):
        for start in range(0, sizes[t], BLOCK):
            n = min(BLOCK, sizes[t] - start)
            x, a = _floats(inputs[t, 0], start, n), scale[0]
            for j in range(n):
                acc[j] = a * np.float64(x[j])
            r = 1
            while r + 4 <= replies:
                x1, a1 = _floats(inputs[t, r], start, n), scale[r]
                x2, a2 = _floats(inputs[t, r + 1], start, n), scale[r + 1]
                x3, a3 = _floats(inputs[t, r + 2], start, n), scale[r + 2]
                x4, a4 = _floats(inputs[t, r + 3], start, n), scale[r + 3]
                for j in range(n):
                    acc[j] = _fma(
                        a4,
                        np.float64(x4[j]),
                        _fma(
                            a3,
                            np.float64(x3[j]),
                            _fma(a2, np.float64(x2[j]), _fma(a1, np.float64(x1[j]), acc[j])),
                        ),
                    )
                r += 4
            while r < replies:
                x, a = _floats(inputs[t, r], start, n), scale[r]
                for j in range(n):
                    acc[j] = _fma(a, np.float64(x[j]), acc[j])
                r += 1
            out = _floats(outputs[t], start, n)
            for j in range(n):
                out[j] = np.float32(acc[j])
