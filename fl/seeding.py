"""Seeds derived from the run seed and a position (round, client), so nothing depends on
call order: a resumed run or a parallel engine draws exactly the same numbers."""

from __future__ import annotations

import numpy as np

__all__ = ["derive_seed"]


def derive_seed(*keys: int) -> int:
    """A 32-bit seed determined by `keys` (e.g. run seed, round, partition)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])
