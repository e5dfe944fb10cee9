"""Confidence intervals over seeds, for comparison tables and plots.

A verdict from a few seeds carries its interval: the Student-t interval of the mean
(the seeds' runs are independent, their figures roughly normal); `fl.run.compare` prints
it and `fl.run.plots` shades it. The normal approximation knows nothing of a figure's
range, so with few seeds it reaches past it (accuracy above 1, a time below 0): each
caller passes the range (`ACCURACY`, `NON_NEGATIVE`, `DIFFERENCE`) and the interval is
clipped to it. Fewer than `FEW_SEEDS` seeds give intervals too wide to say much, which the
comparison says (`few_seeds_warning`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "ACCURACY",
    "DIFFERENCE",
    "FEW_SEEDS",
    "NON_NEGATIVE",
    "few_seeds_warning",
    "interval",
]

Bounds = tuple[float, float]
ACCURACY: Bounds = (0.0, 1.0)
NON_NEGATIVE: Bounds = (0.0, math.inf)  # bytes, seconds, rounds and ratios of them
DIFFERENCE: Bounds = (-1.0, 1.0)  # of two accuracies
FEW_SEEDS = 3


def interval(
    values: Sequence[float], level: float = 0.95, *, bounds: Bounds = (-math.inf, math.inf)
) -> tuple[float, float, float]:
    """The mean and its two-sided Student-t confidence interval over seeds, clipped to
    the figure's `bounds` (a single value: an interval of zero width, which the table
    marks)."""
    from scipy.stats import t  # lazy: scipy costs ~0.3 s, only a sweep's end needs it

    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = float(
        t.ppf(0.5 + level / 2, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    )
    return mean, max(mean - half, bounds[0]), min(mean + half, bounds[1])


def few_seeds_warning(seeds: int) -> str | None:
    """One line saying that `seeds` (< FEW_SEEDS) seeds give intervals that say little."""
    if seeds >= FEW_SEEDS:
        return None
    wide = "a 95 % t-interval 9 standard deviations either side of the mean"
    width = "no interval" if seeds < 2 else wide
    return (
        f"only {seeds} seed{'s' if seeds != 1 else ''} per arm: {width}, so no verdict "
        f"can rest on it; run at least {FEW_SEEDS} seeds (seed=0,1,2)"
    )
