"""Training diagnosis: pure functions and small state of model-update statistics.

Strategies (and metric grafting) compose these with their own actions; nothing here
decides anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl.state import checkpointable

__all__ = [
    "ConsistencyEMA",
    "PerturbationEMA",
    "PlateauDetector",
    "check_tuning_settings",
    "consistency",
    "consistency_ratio",
]


@checkpointable
@dataclass
class PerturbationEMA:
    """APF's effective perturbation, EMA form: P = |EMA(delta)| / EMA(|delta|) per scalar.

    P is 0 for updates that cancel out (a scalar zig-zagging around a fixed value) and 1
    for updates that all point one way. Chen et al., TPDS 2023, eq. 17.
    """

    alpha: float
    signed: torch.Tensor  # E: EMA of the updates
    magnitude: torch.Tensor  # A: EMA of their absolute values

    @classmethod
    def zeros(cls, numel: int, alpha: float) -> PerturbationEMA:
        """Fresh statistics: the first update then gives P = 1."""
        return cls(alpha, torch.zeros(numel), torch.zeros(numel))

    def update(self, delta: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """Fold `delta` into the scalars selected by `where`; return P for those scalars.

        Where the magnitude is still 0 (a scalar that never moved) P is defined as 1:
        the authors' code divides by zero there and so treats it as unstable.
        """
        a = self.alpha
        self.signed[where] = a * self.signed[where] + (1 - a) * delta[where]
        self.magnitude[where] = a * self.magnitude[where] + (1 - a) * delta[where].abs()
        magnitude = self.magnitude[where]
        ratio = self.signed[where].abs() / magnitude.clamp_min(torch.finfo(magnitude.dtype).tiny)
        return torch.where(magnitude > 0, ratio, torch.ones_like(ratio))


def consistency_ratio(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Per scalar |P + N| / (P - N) from pooled positive (>= 0) and negative (<= 0) parts.

    0 where nothing moved (P = N = 0): the GIFT reference code divides by 1 there.
    """
    magnitude = positive - negative
    ratio = (positive + negative).abs() / magnitude.clamp_min(torch.finfo(magnitude.dtype).tiny)
    return torch.where(magnitude > 0, ratio, torch.zeros_like(ratio))


def consistency(updates: torch.Tensor) -> torch.Tensor:
    """Gradient consistency of one round: R[x] = |sum_i g_i[x]| / sum_i |g_i[x]|.

    `updates` is (clients, scalars), each row a client's accumulated update. R is 1 where
    every client moved a scalar the same way and near 0 where their updates cancel out
    ("gradient bifurcation"). Gan et al., PAS, IWQoS 2024, §IV-A; GIFT averages it.
    """
    return consistency_ratio(updates.clamp_min(0).sum(0), updates.clamp_max(0).sum(0))


@checkpointable
@dataclass
class ConsistencyEMA:
    """Gradient consistency with bilateral EMA pooling (PAS §IV-A; GIFT's metric, averaged).

    Two vectors, whatever clients report: P = θP + (1-θ) Σ_i ReLU(g_i) and
    N = θN - (1-θ) Σ_i ReLU(-g_i); R = |P + N| / (P - N). Algebraically the same as
    GIFT's EMA of Σ g over EMA of Σ |g|.
    """

    theta: float
    positive: torch.Tensor
    negative: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, theta: float) -> ConsistencyEMA:
        """Fresh statistics: the first round's R is the raw consistency of that round."""
        return cls(theta, torch.zeros(numel), torch.zeros(numel))

    def update(self, updates: torch.Tensor) -> torch.Tensor:
        """Fold one round's (clients, scalars) updates in; return R per scalar."""
        t = self.theta
        self.positive.mul_(t).add_(updates.clamp_min(0).sum(0), alpha=1 - t)
        self.negative.mul_(t).add_(updates.clamp_max(0).sum(0), alpha=1 - t)
        return self.rate()

    def rate(self) -> torch.Tensor:
        """R per scalar from the current statistics."""
        return consistency_ratio(self.positive, self.negative)

    def reset(self, where: torch.Tensor | None = None) -> None:
        """Forget the history of the selected scalars (all when `where` is None)."""
        if where is None:
            self.positive.zero_()
            self.negative.zero_()
        else:
            self.positive[where] = 0.0
            self.negative[where] = 0.0


def check_tuning_settings(
    ratio: float, ema: float, window: int, window_growth: float, warmup: int
) -> None:
    """Validate the knobs shared by stall-driven tuners (GIFT, PAS), naming the bad key."""
    if ratio <= 1:
        raise ValueError("strategy.ratio must be > 1")
    if not 0 <= ema < 1:
        raise ValueError("strategy.ema must be in [0, 1)")
    if window < 0 or window_growth < 1 or warmup < 0:
        raise ValueError("strategy.window, warmup must be >= 0 and window_growth >= 1")


@checkpointable
@dataclass
class PlateauDetector:
    """Per series: has it stopped reaching new lows? The GIFT/PAS stall test.

    Each element keeps its running minimum and the round it was reached. An element
    "stalls" when `window` rounds passed since its last new low (and the run is past
    `warmup`); it then restarts: minimum forgotten, window multiplied by `growth`
    (longer patience after every action). Window 0 with growth 1 is the one-step test
    "no lower than last round". GIFT reference code: `_as_analyze_gradient`
    (MindSpore), `update_sync_frequency` (Plato).
    """

    low: torch.Tensor  # running minimum since the last restart (+inf: none yet)
    low_round: torch.Tensor  # round at which it was reached (or the restart round)
    window: torch.Tensor  # rounds without a new low that count as a stall
    growth: int
    warmup: int

    @classmethod
    def fresh(cls, numel: int, window: int, *, growth: int = 2, warmup: int = 0) -> PlateauDetector:
        """No minimum yet; every element starts with the same window."""
        return cls(
            torch.full((numel,), torch.inf),
            torch.zeros(numel, dtype=torch.int64),
            torch.full((numel,), window, dtype=torch.int64),
            growth,
            warmup,
        )

    def step(
        self, values: torch.Tensor, server_round: int, eligible: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Observe this round's values; return the mask of elements that stalled (restarted).

        Only `eligible` elements may stall (e.g. those whose period can still shrink);
        the others just track their minimum.
        """
        new_low = values < self.low
        self.low = torch.where(new_low, values.to(self.low.dtype), self.low)
        self.low_round = torch.where(new_low, server_round, self.low_round)
        stalled = ~new_low & (server_round - self.low_round > self.window)
        if server_round <= self.warmup:
            stalled = torch.zeros_like(stalled)
        if eligible is not None:
            stalled &= eligible
        self.restart(stalled, server_round)
        return stalled

    def restart(self, where: torch.Tensor, server_round: int) -> None:
        """Forget the minimum of the selected elements and lengthen their window."""
        self.low[where] = torch.inf
        self.low_round[where] = server_round
        self.window[where] *= self.growth
