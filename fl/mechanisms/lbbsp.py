"""LB-BSP batch sizing: per-worker batches that sum to a fixed global batch.

Chen et al., "Semi-Dynamic Load Balancing", SoCC 2020 / TCC 2023 (spec algorithms_b.md §3).
At every barrier each worker's batch is re-sized so that all finish together while the
global batch X stays fixed, so a batch-weighted gradient is the full-batch one and BSP's
statistics are kept. Two controllers:

- CPU (proportional): x_i = X·v̂_i/Σv̂_j with the speed v̂_i predicted by `LastValue`,
  `EMA` or `NARX` (load signals as exogenous inputs), rounded by largest remainder
  (`proportional_sizes`).
- GPU (`LeaderStraggler`): time is piece-wise linear in batch and memory caps batches, so
  a window of iterations decides a move of Δ samples from the slowest worker to the
  fastest one with memory headroom; Δ halves (and the window grows) when moves reverse.

The NARX here is polynomial (Billings' NARMAX family), linear in its parameters and fit by
ridge least squares (`numpy.linalg.lstsq`); the paper's network sizes were not found.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fl.common.checkpointable import checkpointable

__all__ = [
    "EMA",
    "NARX",
    "PREDICTORS",
    "LastValue",
    "LeaderStraggler",
    "Predictor",
    "make_predictor",
    "proportional_sizes",
]


def _bounds(n: int, total: int, caps: Sequence[int] | None, minimum: int) -> np.ndarray:
    """Each worker's cap, checked: `total` must fit between n·minimum and Σ caps."""
    if n < 1:
        raise ValueError("proportional_sizes: no workers")
    upper = np.full(n, float(total)) if caps is None else np.asarray(caps, dtype=float)
    if upper.shape != (n,):
        raise ValueError(f"proportional_sizes: {len(upper)} caps for {n} workers")
    if (upper < minimum).any():
        raise ValueError(f"proportional_sizes: every cap must be >= the minimum {minimum}")
    if not n * minimum <= total <= upper.sum():
        raise ValueError(
            f"proportional_sizes: a global batch of {total} does not fit {n} workers "
            f"with at least {minimum} each and caps summing to {int(upper.sum())}"
        )
    return upper


def _water_level(w: np.ndarray, total: int, lower: float, upper: np.ndarray) -> np.ndarray:
    """clip(λ·w, lower, upper) summing to `total` (which `_bounds` checked fits). The sum
    grows piecewise linearly in λ, with a kink where a share meets a bound: λ is found
    between the two kinks whose sums straddle `total`, where the sum is linear."""
    kinks = np.unique(np.concatenate([lower / w, upper / w]))
    sums = np.array([np.clip(k * w, lower, upper).sum() for k in kinks])
    # the first kink whose sum reaches `total` (the last one's sum, Σ caps, may fall short by
    # rounding alone: its shares are the caps)
    i = min(int(np.searchsorted(sums, total)), len(kinks) - 1)
    if i == 0 or sums[i] <= total:
        return np.clip(kinks[i] * w, lower, upper)
    level = kinks[i - 1] + (total - sums[i - 1]) / (sums[i] - sums[i - 1]) * (
        kinks[i] - kinks[i - 1]
    )
    return np.clip(level * w, lower, upper)


def proportional_sizes(
    weights: Sequence[float], total: int, caps: Sequence[int] | None = None, minimum: int = 1
) -> list[int]:
    """Integer batches ∝ `weights` that sum to exactly `total`, each in [minimum, cap].

    Water-filling: shares clip(λ·w, minimum, cap) with the level λ that makes them sum to
    `total`; then floors, with the samples left over going to the largest fractional parts
    (ties: lower index).
    """
    w = np.asarray(weights, dtype=float)
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise ValueError(f"proportional_sizes: weights must be finite and > 0, got {list(w)}")
    upper = _bounds(len(w), total, caps, minimum)
    share = _water_level(w, total, float(minimum), upper)
    sizes = np.clip(np.floor(share + 1e-9), minimum, upper).astype(int)
    left = total - int(sizes.sum())
    order = sorted(range(len(w)), key=lambda i: (-(share[i] - sizes[i]), i))
    for i in itertools.islice((i for i in order if sizes[i] < upper[i]), left):
        sizes[i] += 1
    return [int(s) for s in sizes]


# ----- speed predictors (CPU clusters) --------------------------------------------------
class Predictor(Protocol):
    """One worker's next speed from its history; `signals`: load known before the step."""

    def predict(self, signals: Sequence[float] = ()) -> float | None: ...

    def observe(self, speed: float, signals: Sequence[float] = ()) -> None: ...


@checkpointable
class LastValue:
    """v̂_k = v_{k-1}: the baseline every LB-BSP variant starts from."""

    def __init__(self) -> None:
        self.last: float | None = None

    def predict(self, signals: Sequence[float] = ()) -> float | None:
        return self.last

    def observe(self, speed: float, signals: Sequence[float] = ()) -> None:
        self.last = speed


@checkpointable
class EMA:
    """v̂_k = a·v_{k-1} + (1-a)·v̂_{k-1} (the spec's EMA(0.5) by default)."""

    def __init__(self, weight: float = 0.5) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"EMA weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.value: float | None = None

    def predict(self, signals: Sequence[float] = ()) -> float | None:
        return self.value

    def observe(self, speed: float, signals: Sequence[float] = ()) -> None:
        old = speed if self.value is None else self.value
        self.value = self.weight * speed + (1.0 - self.weight) * old


@checkpointable
class NARX:
    """v̂_k = f(v_{k-1..k-p}, u_{k..k-q+1}): polynomial NARX refit by ridge least squares.

    `u` are the load signals (CPU and memory usage) read before step k, so the current
    load informs the prediction; lags of v are what last-value and EMA see alone. Until
    `warmup` observations exist the last value stands in for a fit; afterwards the model
    is refit on the last `window` observations every `refit_every` steps. Degree 1 is an
    ARX model.
    """

    def __init__(
        self,
        speed_lags: int = 2,
        signal_lags: int = 2,  # u_k, u_{k-1}
        degree: int = 2,
        window: int = 200,
        refit_every: int = 50,
        warmup: int = 20,
        ridge: float = 1e-3,  # on standardised features
    ) -> None:
        if min(speed_lags, degree, window, refit_every, warmup) < 1:
            raise ValueError("NARX: lags, degree, window, refit_every and warmup must be >= 1")
        if signal_lags < 0 or ridge < 0:
            raise ValueError("NARX: signal_lags and ridge must be >= 0")
        self.speed_lags, self.signal_lags, self.degree = speed_lags, signal_lags, degree
        self.window, self.refit_every, self.warmup, self.ridge = window, refit_every, warmup, ridge
        self.coef: np.ndarray | None = None
        self._speeds: list[float] = []  # the last `speed_lags`
        self._signals: list[tuple[float, ...]] = []  # the last `signal_lags - 1`
        self._rows: list[tuple[np.ndarray, float]] = []  # the last `window` (lags, speed)
        self._since_fit = 0
        self._scale: tuple[np.ndarray, np.ndarray] | None = None

    def _lags(self, signals: Sequence[float]) -> np.ndarray | None:
        """Regressors for the next step: speed lags and signal lags (None: too short)."""
        if len(self._speeds) < self.speed_lags:
            return None
        recent = [tuple(signals), *reversed(self._signals)][: self.signal_lags]
        if len(recent) < self.signal_lags:
            return None
        speeds = self._speeds[::-1]
        return np.array([*speeds, *itertools.chain.from_iterable(recent)], dtype=float)

    def _features(self, lags: np.ndarray) -> np.ndarray:
        """1, the lags, and their monomials up to `degree` (on standardised lags)."""
        assert self._scale is not None
        z = (lags - self._scale[0]) / self._scale[1]
        terms = [np.ones(1), z]
        for d in range(2, self.degree + 1):
            combos = itertools.combinations_with_replacement(range(len(z)), d)
            terms.append(np.array([np.prod(z[list(c)]) for c in combos]))
        return np.concatenate(terms)

    def _fit(self) -> None:
        lags = np.stack([row for row, _ in self._rows])
        target = np.array([y for _, y in self._rows])
        spread = lags.std(axis=0)
        self._scale = (lags.mean(axis=0), np.where(spread > 0, spread, 1.0))
        x = np.stack([self._features(row) for row in lags])
        penalty = math.sqrt(self.ridge * len(x)) * np.eye(x.shape[1])
        penalty[0, 0] = 0.0  # the intercept is not shrunk
        a = np.vstack([x, penalty])
        b = np.concatenate([target, np.zeros(x.shape[1])])
        self.coef = np.linalg.lstsq(a, b, rcond=None)[0]
        self._since_fit = 0

    def predict(self, signals: Sequence[float] = ()) -> float | None:
        lags = self._lags(signals)
        if self.coef is None or lags is None:
            return self._speeds[-1] if self._speeds else None
        return float(self._features(lags) @ self.coef)

    def observe(self, speed: float, signals: Sequence[float] = ()) -> None:
        lags = self._lags(signals)
        if lags is not None:
            self._rows = [*self._rows, (lags, speed)][-self.window :]
        self._speeds = [*self._speeds, speed][-self.speed_lags :]
        self._signals = [*self._signals, tuple(signals)][-max(self.signal_lags - 1, 1) :]
        self._since_fit += 1
        due = self.coef is None or self._since_fit >= self.refit_every
        if due and len(self._rows) >= self.warmup:
            self._fit()


PREDICTORS = ("last", "ema", "narx")


def make_predictor(name: str, ema_weight: float = 0.5) -> Predictor:
    """A fresh predictor by name: `last`, `ema` or `narx`."""
    if name == "last":
        return LastValue()
    if name == "ema":
        return EMA(ema_weight)
    if name == "narx":
        return NARX()
    raise ValueError(f"predictor must be one of {PREDICTORS}, not {name!r}")


# ----- leader/straggler loop (GPU clusters) ---------------------------------------------
@dataclass
class LeaderStraggler:
    """The GPU rule: move Δ samples from the straggler to the fastest worker with headroom.

    Iteration times are averaged over a window of W iterations; then, unless the spread
    (t_max - t_min)/t_max is below `tolerance`, Δ samples move from the slowest worker to
    the fastest one below its memory cap. When a move reverses the last one (the pair
    flipped), Δ halves and W doubles (up to `max_window`) to damp noise. The total never
    changes; no batch leaves [minimum, cap].
    """

    sizes: list[int]
    caps: list[int]
    step: int  # Δ
    window: int = 5  # W
    max_window: int = 40
    tolerance: float = 0.05
    minimum: int = 1
    moves: int = 0
    _last: tuple[int, int] | None = None  # (from, to) of the last move
    _times: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.caps) or len(self.sizes) < 2:
            raise ValueError("LeaderStraggler: one cap per worker, at least two workers")
        if any(not self.minimum <= s <= c for s, c in zip(self.sizes, self.caps, strict=True)):
            raise ValueError(
                f"LeaderStraggler: sizes {self.sizes} must lie in "
                f"[{self.minimum}, caps {self.caps}]"
            )
        if self.step < 1 or self.window < 1:
            raise ValueError("LeaderStraggler: step and window must be >= 1")

    @classmethod
    def even(cls, total: int, caps: Sequence[int], **options: int | float) -> LeaderStraggler:
        """Start from BSP's equal split (within caps); Δ0 = 10 % of the mean batch."""
        sizes = proportional_sizes([1.0] * len(caps), total, caps, int(options.get("minimum", 1)))
        step = max(1, round(0.1 * total / len(caps)))
        return cls(sizes, list(caps), step, **options)  # type: ignore[arg-type]

    def spread(self, times: Sequence[float]) -> float:
        """(t_max - t_min) / t_max, t_min over the workers below their memory cap (a
        capped worker finishing early is no imbalance the loop can remove)."""
        free = [t for t, s, c in zip(times, self.sizes, self.caps, strict=True) if s < c]
        return (max(times) - min(free)) / max(times) if free else 0.0

    def observe(self, times: Sequence[float]) -> list[int]:
        """Fold in one iteration's per-worker times; the sizes of the next iteration."""
        if len(times) != len(self.sizes):
            raise ValueError(f"LeaderStraggler: {len(times)} times for {len(self.sizes)} workers")
        self._times.append([float(t) for t in times])
        if len(self._times) < self.window:
            return list(self.sizes)
        mean = np.mean(self._times, axis=0)
        self._times = []
        if self.spread(mean) < self.tolerance:
            return list(self.sizes)
        straggler = int(np.argmax(mean))
        roomy = [i for i in range(len(mean)) if i != straggler and self.sizes[i] < self.caps[i]]
        if not roomy or self.sizes[straggler] <= self.minimum:
            return list(self.sizes)
        leader = min(roomy, key=lambda i: (mean[i], i))
        if self._last == (leader, straggler):  # the pair flipped: oscillation
            self.step = max(1, self.step // 2)
            self.window = min(2 * self.window, self.max_window)
        delta = min(
            self.step,
            self.sizes[straggler] - self.minimum,
            self.caps[leader] - self.sizes[leader],
        )
        self.sizes[straggler] -= delta
        self.sizes[leader] += delta
        self._last = (straggler, leader)
        self.moves += 1
        return list(self.sizes)
