"""Seeds derived from positions: `derive_seeds` (a cohort's at once) is `derive_seed`."""

import random

import numpy as np
import pytest

from fl.common.seeding import derive_seed, derive_seeds


def test_derived_together_is_derived_one_by_one():
    rng = random.Random(0)
    edge = [0, 1, 2, 2**31, 2**32 - 1]
    for count in range(1, 17):  # from fewer keys than SeedSequence's pool to its table's end
        for _ in range(60):
            keys = [
                rng.choice([*edge, rng.randrange(2**32), rng.randrange(1000)]) for _ in range(count)
            ]
            assert derive_seeds(*keys) == [derive_seed(*keys)]
    partitions = np.arange(5000)
    assert derive_seeds(7, 3, partitions) == [derive_seed(7, 3, int(p)) for p in partitions]
    rounds = [1, 2, 3]
    assert derive_seeds(0, rounds, [9, 8, 7]) == [
        derive_seed(0, r, p) for r, p in zip(rounds, [9, 8, 7], strict=True)
    ]


def test_keys_outside_32_bits_take_seedsequence_itself():
    big = 2**40 + 5  # SeedSequence splits it into two words: the slow path, same values
    assert derive_seeds(big, [1, 2]) == [derive_seed(big, 1), derive_seed(big, 2)]
    with pytest.raises(ValueError):  # SeedSequence's own refusal of a negative key
        derive_seeds(1, [0, -1])
    with pytest.raises(ValueError, match="different lengths"):
        derive_seeds([1, 2], [1, 2, 3])
