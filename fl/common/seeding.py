"""Determinism: seeds derived from the run seed and a position (round, client), so nothing
depends on call order, and torch's thread count fixed by the run, so float reductions
sum in the same order on every machine and engine."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["derive_seed", "pin_torch_threads"]


def derive_seed(*keys: int) -> int:
    """A 32-bit seed determined by `keys` (e.g. run seed, round, partition)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


def pin_torch_threads(threads: int) -> None:
    """Use `threads` intra-op threads in this process (0: torch's default, the core count).

    Every process of a run (ServerApp, each ClientApp, on any engine) calls this with the
    run's `torch_threads`: the thread count changes how float sums are split, so results
    differ in the last digits between machines unless it is fixed.
    """
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
