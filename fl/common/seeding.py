"""Determinism: seeds derived from the run seed and a position (round, client), so nothing
depends on call order, and torch's thread count fixed by the run, so float reductions
sum in the same order on every machine and engine. What a seed cannot fix, the CPU's
kernels (a model and instruction set may round differently in the last bit, and a long run
amplifies it), `machine` records beside each result."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["derive_seed", "derive_seeds", "is_seed_word", "machine", "pin_torch_threads"]

# numpy's SeedSequence (bit_generator.pyx), unrolled for `derive_seeds`: its hashmix's
# (xor, multiplier) pairs in call order, its mix and its first output word's constants
_MASK = 0xFFFFFFFF
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _POOL = 0xCA01F9DD, 0x4973F715, 4
_MAX_KEYS = 16  # hashmix pairs are tabled for this many keys: the pool's own mixing, then
_HASHMIXES = _POOL * _POOL + _POOL * (_MAX_KEYS - _POOL)  # each key past the pool per word
_HASH = [
    (_INIT_A * _MULT_A**i & _MASK, _INIT_A * _MULT_A ** (i + 1) & _MASK) for i in range(_HASHMIXES)
]


def derive_seed(*keys: int) -> int:
    """A 32-bit seed determined by `keys` (e.g. run seed, round, partition)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


def derive_seeds(*keys: int | Sequence[int]) -> list[int]:
    """`derive_seed` for many positions at once: each key an int or a sequence (all
    sequences of one length), the seeds of their rows; e.g. `derive_seeds(seed, round,
    partitions)` for a cohort (exactly `derive_seed`'s values, ~100× faster than a loop
    of it: SeedSequence's hashing as numpy kernels, for keys that are 32-bit words)."""
    lengths = {len(k) for k in keys if not isinstance(k, int)}
    if len(lengths) > 1:
        raise ValueError(f"key sequences of different lengths {sorted(lengths)}")
    rows = lengths.pop() if lengths else 1
    columns = [np.broadcast_to(np.asarray(k, dtype=np.int64), (rows,)) for k in keys]
    if not keys or len(keys) > _MAX_KEYS or any(((c < 0) | (c > _MASK)).any() for c in columns):
        return [derive_seed(*(int(c[r]) for c in columns)) for r in range(rows)]
    words = [c.astype(np.uint64) for c in columns]
    words += [np.zeros(rows, np.uint64)] * (_POOL - len(words))
    constants = iter(_HASH)

    def hashmix(value: np.ndarray) -> np.ndarray:
        xor, multiplier = next(constants)
        return _fold(np.multiply(np.bitwise_xor(value, np.uint64(xor)), np.uint64(multiplier)))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return _fold(
            np.subtract(np.multiply(np.uint64(_MIX_L), x), np.multiply(np.uint64(_MIX_R), y))
        )

    pool = [hashmix(words[i]) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for word in words[_POOL:]:
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(word))
    first = np.uint64(_INIT_B * _MULT_B & _MASK)
    return _fold(np.multiply(np.bitwise_xor(pool[0], np.uint64(_INIT_B)), first)).tolist()


def is_seed_word(value: object) -> bool:
    """Whether `value` is an int that fits a 32-bit word: a key `derive_seeds` hashes
    itself (others take SeedSequence's own path, which refuses negatives)."""
    return isinstance(value, int) and 0 <= value <= _MASK


def _fold(value: np.ndarray) -> np.ndarray:
    """SeedSequence's step after each product: the low 32 bits, xor-shifted by 16."""
    low = np.bitwise_and(value, np.uint64(_MASK))
    return np.bitwise_xor(low, np.right_shift(low, np.uint64(16)))


def pin_torch_threads(threads: int) -> None:
    """Use `threads` intra-op threads in this process (0: torch's default, the core count).

    Every process of a run (ServerApp, each ClientApp, on any engine) calls this with the
    run's `torch_threads`: the thread count changes how float sums are split, so results
    differ in the last digits between machines unless it is fixed.
    """
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def machine() -> dict[str, str]:
    """The machine a result was computed on, as far as it decides the bits: the CPU model,
    the instruction set torch's own kernels dispatch to, any cap on oneDNN's (its convolutions
    and matmuls: `ONEDNN_MAX_CPU_ISA`), and torch's and NumPy's versions."""
    return {
        "cpu": _cpu_model(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL"),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
