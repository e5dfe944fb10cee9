"""Training diagnosis: pure functions and small state of model-update statistics.

Strategies (and metric grafting, `strategies/graft.py`) compose these with actions
(`fl.mechanisms.actions`) and control laws (`fl.mechanisms.laws`); nothing here decides
anything. Every
`Diagnosis` is computed on the server from what a round already brings it (the global
model before and after, the accepted client updates and their reported losses): no
extra traffic, nothing private beyond the updates themselves.

The catalogue (spec algorithms_b.md §4.2; the grafting study itself is our
reconstruction, the paper's text being unavailable): loss ratio (AdaComm,
AdaQuantFL), gradient-consistent rate (GIFT, PAS), effective stepping rate (APF),
second-order oscillation ratio (FedSU), relevance (CMFL), significance (Gaia).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from fl.common.checkpointable import checkpointable

__all__ = [
    "DIAGNOSES",
    "SCOPES",
    "WINDOW_RULES",
    "ConsistencyEMA",
    "ConsistencyRate",
    "Diagnosis",
    "LinearityTest",
    "LossRatio",
    "OscillationRatio",
    "PerturbationEMA",
    "PlateauDetector",
    "Relevance",
    "RoundView",
    "Significance",
    "SteppingRate",
    "check_tuning_settings",
    "consistency",
    "consistency_ratio",
    "make_diagnosis",
    "pool",
    "settled_value",
    "smoothing_of",
    "stall_detector",
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
    ratio: float,
    ema: float,
    window: int,
    window_growth: float,
    warmup: int,
    window_rule: str = "doubling",
) -> None:
    """Validate the knobs shared by stall-driven tuners (GIFT, PAS), naming the bad key."""
    if ratio <= 1:
        raise ValueError("strategy.ratio must be > 1")
    if not 0 <= ema < 1:
        raise ValueError("strategy.ema must be in [0, 1)")
    if window < 0 or window_growth < 1 or warmup < 0:
        raise ValueError("strategy.window, warmup must be >= 0 and window_growth >= 1")
    if window_rule not in WINDOW_RULES:
        raise ValueError(
            f"strategy.window_rule must be one of {list(WINDOW_RULES)}, not {window_rule!r}"
        )
    if window_rule == "fixed" and window < 1:
        raise ValueError("strategy.window must be >= 1 under window_rule=fixed")


WINDOW_RULES = ("fixed", "doubling", "one_step")


def stall_detector(
    numel: int, rule: str, window: int, *, growth: int = 2, warmup: int = 0
) -> PlateauDetector:
    """The stall test of GIFT and PAS under a window rule (spec §3.3).

    `fixed` (default): a stall is `window` rounds without the value falling, the same
    window after every action; `doubling`: GIFT's reference code, no new low for more than
    `window` rounds and the window multiplied by `growth` after every action; `one_step`:
    the value did not fall since last round (`window` unused).
    """
    if rule == "fixed":
        return PlateauDetector.fresh(numel, window, growth=1, warmup=warmup, baseline=True)
    if rule == "doubling":
        return PlateauDetector.fresh(numel, window, growth=growth, warmup=warmup)
    if rule == "one_step":
        return PlateauDetector.fresh(numel, 0, growth=1, warmup=warmup)
    raise ValueError(f"strategy.window_rule must be one of {list(WINDOW_RULES)}, not {rule!r}")


@checkpointable
@dataclass
class PlateauDetector:
    """Per series: has it stopped reaching new lows? The GIFT/PAS stall test.

    Each element keeps its running minimum and the round it was reached. An element
    "stalls" when more than `window` rounds passed since its last new low (and the run is
    past `warmup`); it then restarts: minimum forgotten, window multiplied by `growth`
    (longer patience after every action). Window 0 with growth 1 is the one-step test
    "no lower than last round". GIFT reference code: `_as_analyze_gradient`
    (MindSpore), `update_sync_frequency` (Plato).
    With `baseline` (the fixed rule, `stall_detector`), the first value after a restart only
    sets the minimum: a stall is `window` rounds in which the series did not fall below an
    earlier value since the restart, so a series that never falls stalls every `window` rounds.
    """

    SENTINELS: ClassVar[tuple[str, ...]] = ("low",)  # +inf there is "none yet", not a fault
    low: torch.Tensor  # running minimum since the last restart (+inf: none yet)
    low_round: torch.Tensor  # round at which it was reached (or the restart round)
    window: torch.Tensor  # rounds without a new low that count as a stall
    growth: int
    warmup: int
    baseline: bool = False  # the fixed rule's count (see above); False: the reference code's

    @classmethod
    def fresh(
        cls, numel: int, window: int, *, growth: int = 2, warmup: int = 0, baseline: bool = False
    ) -> PlateauDetector:
        """No minimum yet; every element starts with the same window."""
        return cls(
            torch.full((numel,), torch.inf),
            torch.zeros(numel, dtype=torch.int64),
            torch.full((numel,), window, dtype=torch.int64),
            growth,
            warmup,
            baseline,
        )

    def step(
        self, values: torch.Tensor, server_round: int, eligible: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Observe this round's values; return the mask of elements that stalled (restarted).

        Only `eligible` elements may stall (e.g. those whose period can still shrink);
        the others just track their minimum.
        """
        new_low = values < self.low
        if self.baseline:  # a first value after a restart is no fall
            new_low &= torch.isfinite(self.low)
            self.low = torch.minimum(self.low, values.to(self.low.dtype))
        else:
            self.low = torch.where(new_low, values.to(self.low.dtype), self.low)
        self.low_round = torch.where(new_low, server_round, self.low_round)
        waited = server_round - self.low_round
        stalled = ~new_low & (waited >= self.window if self.baseline else waited > self.window)
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


# ----- the common interface of metric grafting -------------------------------------------
SCOPES = ("global", "layer", "scalar")


@dataclass(frozen=True)
class RoundView:
    """What the server knows once a round is aggregated: all a diagnosis may read."""

    server_round: int
    before: torch.Tensor  # the global vector the round's clients started from
    after: torch.Tensor  # the new global vector
    deltas: torch.Tensor  # (clients, scalars): each accepted update minus `before`
    losses: torch.Tensor  # (clients,): their reported mean training loss
    weights: torch.Tensor  # (clients,): their (bounded) example counts
    sizes: tuple[int, ...]  # scalars per model tensor (`Layout.sizes`), for layer scope
    active: torch.Tensor | None = None  # scalars that trained this round (None: all)

    @property
    def where(self) -> torch.Tensor:
        """The `active` mask, all True when every scalar trained."""
        if self.active is None:
            return torch.ones(self.before.numel(), dtype=torch.bool)
        return self.active


class Diagnosis(Protocol):
    """One training-status metric: fold a round in, return its value(s) this round.

    Global metrics return one value (shape (1,)), per-scalar ones a value per scalar;
    `pool` turns the latter into per-layer or global values. Instances are
    `@checkpointable` dataclasses, so a run resumes with their history.
    """

    def observe(self, view: RoundView) -> torch.Tensor: ...


def pool(values: torch.Tensor, scope: str, view: RoundView) -> torch.Tensor:
    """Per-scalar `values` as the scope asks: as they are, the mean of each layer's
    active scalars, or the mean over all active scalars (a scope-free value passes)."""
    if values.numel() == 1 or scope == "scalar":
        return values
    where = view.where.to(values.dtype)
    if scope == "global":
        return (values * where).sum().reshape(1) / where.sum().clamp_min(1)
    sums = [
        (v * w).sum() / w.sum().clamp_min(1)
        for v, w in zip(
            torch.split(values, list(view.sizes)), torch.split(where, list(view.sizes)), strict=True
        )
    ]
    return torch.stack(sums)


@checkpointable
@dataclass
class LossRatio:
    """F_k / F_0: the round's example-weighted mean training loss over the first round's
    (AdaComm, Wang & Joshi; AdaQuantFL, Jhunjhunwala et al.). Starts at 1, falls as the
    model learns."""

    first: float = math.nan

    def observe(self, view: RoundView) -> torch.Tensor:
        loss = float((view.losses * view.weights).sum() / view.weights.sum())
        if math.isnan(self.first):
            self.first = loss
        return torch.tensor([loss / self.first if self.first > 0 else 1.0])


@checkpointable
@dataclass
class ConsistencyRate:
    """Gradient-consistent rate R = |P + N| / (P - N) with PAS's bilateral EMA pooling
    (`ConsistencyEMA`), per scalar; GIFT's model-level value is its global mean."""

    ema: ConsistencyEMA

    @classmethod
    def fresh(cls, numel: int, theta: float) -> ConsistencyRate:
        return cls(ConsistencyEMA.zeros(numel, theta))

    def observe(self, view: RoundView) -> torch.Tensor:
        return self.ema.update(view.deltas)


@checkpointable
@dataclass
class SteppingRate:
    """APF's effective stepping rate |EMA(Δ)| / EMA(|Δ|) of each scalar's global update,
    folded in only where the scalar trained (1, "unstable", before its first move)."""

    ema: PerturbationEMA

    @classmethod
    def fresh(cls, numel: int, alpha: float) -> SteppingRate:
        return cls(PerturbationEMA.zeros(numel, alpha))

    def observe(self, view: RoundView) -> torch.Tensor:
        return self.rate(view.after - view.before, view.where)

    def rate(self, change: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """Fold `change` in where `where` holds; the rate of every scalar (1 elsewhere)."""
        rate = torch.ones(change.numel())
        rate[where] = self.ema.update(change, where)
        return rate


@checkpointable
@dataclass
class LinearityTest:
    """FedSU's linearity metric per scalar, from the round updates g of the global model.

    `ema` folds in second differences; `previous` is the last update seen; `samples`
    counts the second differences folded in since the last reset (R is 1, "unknown",
    before the first). A scalar whose second differences were all exactly zero (a
    scalar that never moves, or moves by exactly the same step) has R = 0: perfectly
    predictable, APF's stalled case with slope 0.
    """

    ema: PerturbationEMA
    previous: torch.Tensor
    seen: torch.Tensor  # bool: `previous` holds an update
    samples: torch.Tensor  # int64

    @classmethod
    def fresh(cls, numel: int, theta: float) -> LinearityTest:
        """No history: every scalar needs two updates before it can be judged."""
        return cls(
            PerturbationEMA.zeros(numel, theta),
            torch.zeros(numel),
            torch.zeros(numel, dtype=torch.bool),
            torch.zeros(numel, dtype=torch.int64),
        )

    def update(self, update: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """Fold this round's update g of the scalars in `where`; return R for all scalars
        (1 outside `where` and wherever no second difference is known yet)."""
        judged = where & self.seen
        second = update - self.previous
        rate = torch.ones_like(update)
        if bool(judged.any()):
            ratio = self.ema.update(second, judged)
            moved = self.ema.magnitude[judged] > 0
            rate[judged] = torch.where(moved, ratio, torch.zeros_like(ratio))
            self.samples[judged] += 1
        self.previous[where] = update[where]
        self.seen |= where
        return rate

    def reset(self, where: torch.Tensor, previous: torch.Tensor) -> None:
        """Forget the EMAs of the scalars in `where` (FedSU: when they return to regular
        synchronisation); `previous` is the last update they made."""
        self.ema.signed[where] = 0.0
        self.ema.magnitude[where] = 0.0
        self.samples[where] = 0
        self.previous[where] = previous[where]
        self.seen |= where


@checkpointable
@dataclass
class OscillationRatio:
    """FedSU's second-order oscillation ratio |EMA(g')| / EMA(|g'|) of the global round
    updates g (`LinearityTest`): near 0 where a scalar moves linearly.
    FedSU's diagnosis (`strategies/fedsu.py`), which uses the test directly."""

    test: LinearityTest

    @classmethod
    def fresh(cls, numel: int, theta: float) -> OscillationRatio:
        return cls(LinearityTest.fresh(numel, theta))

    def observe(self, view: RoundView) -> torch.Tensor:
        return self.test.update(view.after - view.before, view.where)


@checkpointable
@dataclass
class Relevance:
    """CMFL's relevance: the share of scalars whose client update has the sign of the last
    global update (product >= 0), example-weighted over the round's clients (1 before
    any global update is known). Wang, Wang & Li, ICDCS 2019."""

    last_update: torch.Tensor | None = None

    def observe(self, view: RoundView) -> torch.Tensor:
        if self.last_update is None:
            value = torch.ones(1)
        else:
            where = view.where
            agree = (view.deltas[:, where] * self.last_update[where] >= 0).double().mean(1)
            value = ((agree * view.weights).sum() / view.weights.sum()).float().reshape(1)
        self.last_update = view.after - view.before
        return value


@checkpointable
@dataclass
class Significance:
    """Gaia's significance |w_before / w_after - 1| per scalar, reported as 1 where it
    exceeds `threshold` (Gaia's 0.01) and 0 elsewhere, so its global mean is the share of
    significant scalars. Hsieh et al., NSDI 2017."""

    threshold: float = 0.01

    def observe(self, view: RoundView) -> torch.Tensor:
        change = (view.before - view.after).abs()
        relative = change / view.after.abs().clamp_min(torch.finfo(change.dtype).tiny)
        return (relative > self.threshold).float()


# name -> (factory from (numel, smoothing), whether its values are per scalar)
DIAGNOSES: dict[str, tuple[Any, bool]] = {
    "loss": (lambda numel, smoothing: LossRatio(), False),
    "consistency": (ConsistencyRate.fresh, True),
    "stepping": (SteppingRate.fresh, True),
    "oscillation": (OscillationRatio.fresh, True),
    "relevance": (lambda numel, smoothing: Relevance(), False),
    "significance": (lambda numel, smoothing: Significance(), True),
}

# Each smoothed diagnosis keeps its original's EMA weight: APF's α = 0.99 (S-APF-J §VII-A),
# FedSU's θ = 0.99 (spec §5.2 proposal), PAS's θ = 0.9 (our `conf/strategy/pas.yaml`).
ORIGINAL_SMOOTHING = {"consistency": 0.9, "stepping": 0.99, "oscillation": 0.99}

# The value at which each diagnosis's original calls training settled, in its own units
# (the loss ratio's is 0): APF freezes below T_s = 0.05, FedSU speculates below T_R = 0.01,
# CMFL drops an update below relevance 0.7, Gaia has no significant scalar left at 0, and
# PAS's analysis marks the "gradient-counteracting moment" at a consistent rate below 0.1
# (S-PAS Fig. 2; not part of PAS's own stall rule, nor GIFT's).
SETTLED = {"loss": 0.0, "consistency": 0.1, "stepping": 0.05, "oscillation": 0.01}
SETTLED |= {"relevance": 0.7, "significance": 0.0}


def smoothing_of(name: str, smoothing: float | None) -> float:
    """The EMA weight diagnosis `name` uses: `smoothing`, or its original's when None."""
    if smoothing is not None:
        return smoothing
    return ORIGINAL_SMOOTHING.get(name, 0.0)


def settled_value(name: str) -> float:
    """Where diagnosis `name` says "training settled", in its own units (`SETTLED`)."""
    return SETTLED[name]


def make_diagnosis(name: str, numel: int, smoothing: float | None = None) -> Diagnosis:
    """The diagnosis called `name` for a model of `numel` scalars (`smoothing`: the EMA
    weight of those that keep one; None: its original's, `ORIGINAL_SMOOTHING`)."""
    if name not in DIAGNOSES:
        raise ValueError(f"unknown diagnosis {name!r}; known: {sorted(DIAGNOSES)}")
    factory, _ = DIAGNOSES[name]
    return factory(numel, smoothing_of(name, smoothing))
