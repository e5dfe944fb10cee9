"""Confidence intervals over seeds, for comparison tables and plots.

A verdict from a few seeds carries its interval: the Student-t interval of the mean
(the seeds' runs are independent, their figures roughly normal); `fl.run.compare` prints
it and `fl.run.plots` shades it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["interval"]


def interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """The mean and its two-sided Student-t confidence interval over seeds (a single
    value: an interval of zero width, which the table marks)."""
    from scipy.stats import t  # lazy: scipy costs ~0.3 s, only a sweep's end needs it

    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = float(
        t.ppf(0.5 + level / 2, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    )
    return mean, mean - half, mean + half
