"""2D-LRD: two-dimensional learning-rate decay, across rounds and across local steps.

Mo, Chen, Li, Xu, Xue, "Two-dimensional learning rate decay: Towards accurate federated
learning with non-IID data", IJCNN 2021: only the abstract is known (spec
shared/specs/algorithms_a.md §7.1). It asks for a learning rate decreased gradually on two
axes, rounds and the local iterations of a round, at different speeds, with "the sum of the
inner product of round updates" as the signal. The rules below follow that; their details
(window, factors, floor, the in-round signal) are OUR choices (spec §7.2), not the paper's.

The learning rate of local step k (0-based) in round r is

    η(r, k) = η_0 · a_r · γ_r^k

- a_r, the round axis, decays gradually (`round_rule`):
  - `inner_product_sum` (default; our reading of the abstract): p_r = <Δ_r, Δ_{r-1}>, the
    unnormalised inner product of consecutive global round updates Δ_r (new global model
    minus old). S_r is the sum of the last W such products made since the last decay (the
    abstract's "sum of the inner product of round updates"; the window forgets the large
    early steps, which would otherwise keep the sum positive for ever). Once W products
    are in and S_r < 0 (the recent global steps cancel on balance, big steps weighing more
    than small ones: the model oscillates), a_{r+1} = max(a_min, γ_R · a_r) and the sum
    restarts; otherwise a_{r+1} = a_r. γ_R = 0.9 and a_min = 0.1 make the decay gradual
    and keep the floor well above zero ("gradually" rules out halving to a tiny floor).
  - `halving_cosine` (ablation: the rule before issue 35): S_r = cos(Δ_r, Δ_{r-1}) (0 when
    either is 0), E_r = β E_{r-1} + (1 - β) S_r; when E_r < 0 and more than W rounds
    passed since the last decay, a_{r+1} = max(a_min, γ_R · a_r), with the old constants
    γ_R = 0.5, a_min = 0.01 (conf/strategy/lrd2d_halving.yaml).
  a_1 = 1, and a_r never falls below a_min.
- γ_r, the in-round axis, decays fast (every local step), driven by client agreement:
  D_r = Σ_{i<j} <g_i, g_j> / Σ_{i<j} |g_i| |g_j| over the round's client updates g_i
  (1 when there is no pair of non-zero updates), and γ_{r+1} = γ_min^(1 - clip(D_r, 0, 1)):
  no in-round decay when clients agree, per-step factor γ_min when their updates are
  orthogonal or opposed, since late local steps then mostly add client drift. γ_1 = 1.

The server computes both from the updates it already has (no extra traffic) and sends
a_r and γ_r in each train instruction (`lrd-round-factor`, `lrd-step-decay`); the
client's `lr` hook applies them at every local step. `axes` switches factors off for
the ablations: `round` (γ ≡ 1), `inround` (a ≡ 1), `none` (constant learning rate,
identical to FedAvg; the signals are still measured and logged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from fl.common.checkpointable import checkpointable
from fl.strategy.client import ClientHooks, Reply
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.records import Layout

AXES = ("both", "round", "inround", "none")
ROUND_RULES = ("inner_product_sum", "halving_cosine")
ROUND_FACTOR_KEY, STEP_DECAY_KEY = "lrd-round-factor", "lrd-step-decay"
LAST_LR_KEY = "lrd-last-lr"


@dataclass
class LRDParams:
    """All our values (the abstract gives none): gentle γ_R and a floor well above 0."""

    axes: str = "both"  # both | round | inround | none: which factors are applied
    round_rule: str = "inner_product_sum"  # inner_product_sum | halving_cosine (ablation)
    round_decay: float = 0.9  # γ_R: a ← γ_R · a when the round signal says "oscillating"
    round_ema: float = 0.5  # β of the EMA of cos(Δ_r, Δ_{r-1}) (halving_cosine only)
    round_window: int = 5  # W: products summed; a decays at most once every W rounds
    min_round_factor: float = 0.1  # a_min: floor of the round factor
    step_decay: float = 0.97  # γ_min: per-step factor when clients do not agree at all

    def validate(self) -> None:
        if self.axes not in AXES:
            raise ValueError(f"strategy.axes must be one of {AXES}, got {self.axes!r}")
        if self.round_rule not in ROUND_RULES:
            raise ValueError(f"strategy.round_rule must be one of {ROUND_RULES}")
        if not 0 < self.round_decay <= 1:
            raise ValueError("strategy.round_decay must be in (0, 1]")
        if not 0 <= self.round_ema < 1:
            raise ValueError("strategy.round_ema must be in [0, 1)")
        if self.round_window < 0 or (self.round_rule == ROUND_RULES[0] and self.round_window < 1):
            raise ValueError("strategy.round_window must be >= 0 (>= 1 for inner_product_sum)")
        if not 0 < self.min_round_factor <= 1:
            raise ValueError("strategy.min_round_factor must be in (0, 1]")
        if not 0 < self.step_decay <= 1:
            raise ValueError("strategy.step_decay must be in (0, 1]")


# ----- the two signals and the schedule ---------------------------------------------------
def inner_product(update: torch.Tensor, previous: torch.Tensor) -> float:
    """p = <Δ_r, Δ_{r-1}> of two consecutive global updates, in float64."""
    return float(update.double() @ previous.double())


def update_correlation(update: torch.Tensor, previous: torch.Tensor) -> float:
    """S = cos(Δ_r, Δ_{r-1}) of two consecutive global updates; 0 when either is zero."""
    a, b = update.double(), previous.double()
    norms = float(torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b))
    return float(a @ b) / norms if norms > 0 else 0.0


def client_agreement(updates: torch.Tensor) -> float:
    """D = Σ_{i<j} <g_i, g_j> / Σ_{i<j} |g_i| |g_j| of the (clients, scalars) updates.

    Both sums come from O(n d) totals: Σ_{i<j} <g_i, g_j> = (|Σ g|² - Σ |g|²) / 2 and
    Σ_{i<j} |g_i| |g_j| = ((Σ |g|)² - Σ |g|²) / 2. 1 when no pair of non-zero updates exists.
    """
    g = updates.double()
    norms = torch.linalg.vector_norm(g, dim=1)
    squares = float((norms**2).sum())
    pairs = float(norms.sum() ** 2) - squares
    if pairs <= 0:
        return 1.0
    return (float(torch.linalg.vector_norm(g.sum(0)) ** 2) - squares) / pairs


def step_decay_for(agreement: float, params: LRDParams) -> float:
    """γ = γ_min^(1 - clip(D, 0, 1)): 1 at full agreement, γ_min at none."""
    return params.step_decay ** (1.0 - min(max(agreement, 0.0), 1.0))


def scheduled_lr(base_lr: float, round_factor: float, step_decay: float, step: int) -> float:
    """η(r, k) = η_0 · a_r · γ_r^k (exactly η_0 when both factors are 1)."""
    return base_lr * round_factor * step_decay**step


@checkpointable
@dataclass
class DecaySchedule:
    """The factors for the next round and what the round axis remembers."""

    round_factor: float = 1.0  # a for the next round
    step_decay: float = 1.0  # γ for the next round
    correlation_ema: float = 0.0  # E (halving_cosine)
    products: list[float] = field(default_factory=list)  # p of the window, since the last decay
    last_decay: int = 0  # round of the last decay of a (0: none yet)
    previous_update: torch.Tensor | None = None  # Δ_{r-1}
    decays: list[tuple[int, float]] = field(default_factory=list)  # (round, new a)

    @property
    def product_sum(self) -> float:
        """S_r: the sum of the inner products in the window (0 when it is empty)."""
        return math.fsum(self.products)

    def advance(
        self, update: torch.Tensor, agreement: float, server_round: int, params: LRDParams
    ) -> tuple[float, float]:
        """Fold round r's global update and client agreement in; return (p_r, cos) of Δ_r
        and Δ_{r-1} (nan in the first round, which has no previous update)."""
        product = correlation = math.nan
        if self.previous_update is not None:
            product = inner_product(update, self.previous_update)
            correlation = update_correlation(update, self.previous_update)
            beta = params.round_ema
            self.correlation_ema = beta * self.correlation_ema + (1 - beta) * correlation
            self.products = [*self.products, product][-max(params.round_window, 1) :]
            if params.axes in ("both", "round") and self._oscillating(server_round, params):
                self.round_factor = max(
                    params.min_round_factor, params.round_decay * self.round_factor
                )
                self.last_decay = server_round
                self.products = []
                self.decays.append((server_round, self.round_factor))
        self.previous_update = update.clone()
        if params.axes in ("both", "inround"):
            self.step_decay = step_decay_for(agreement, params)
        return product, correlation

    def _oscillating(self, server_round: int, params: LRDParams) -> bool:
        """Whether the round rule decays a now (never below the floor)."""
        if self.round_factor <= params.min_round_factor:
            return False
        if params.round_rule == "halving_cosine":
            waited = server_round - self.last_decay > params.round_window
            return self.correlation_ema < 0 and waited
        return len(self.products) >= params.round_window and self.product_sum < 0


# ----- server half ------------------------------------------------------------------------
class LRDServer(ServerStrategy):
    """FedAvg that measures both signals while aggregating and ships the next factors."""

    params: LRDParams
    state_attributes = ("schedule",)

    def __init__(self, params: LRDParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.schedule = DecaySchedule()
        self.sent = (1.0, 1.0)  # (a, γ) of the current round
        self.correlation = self.agreement = self.product = math.nan

    def on_round_start(self, server_round: int) -> None:
        self.sent = (self.schedule.round_factor, self.schedule.step_decay)
        self.correlation = self.agreement = self.product = math.nan

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        return {ROUND_FACTOR_KEY: self.sent[0], STEP_DECAY_KEY: self.sent[1]}

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        old = self.global_vector
        self.agreement = client_agreement(torch.stack([u.vector - old for u in updates]))
        new = super().aggregate(server_round, updates)
        self.product, self.correlation = self.schedule.advance(
            new - old, self.agreement, server_round, self.params
        )
        return new

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        # reported by clients, so untrusted: logged only, and only if it is a number
        reported = [u.metrics.get(LAST_LR_KEY) for u in self.stats.updates]
        last = [float(v) for v in reported if isinstance(v, int | float)]
        out.update(
            lr_round_factor=self.sent[0],
            lr_step_decay=self.sent[1],
            update_inner_product=self.product,
            inner_product_sum=self.schedule.product_sum,
            update_correlation=self.correlation,
            update_correlation_ema=self.schedule.correlation_ema,
            client_agreement=self.agreement,
            client_last_lr=sum(last) / len(last) if last else math.nan,
        )
        return out


# ----- client half ------------------------------------------------------------------------
class LRDHooks(ClientHooks):
    """Applies η_0 · a · γ^k at every local step; reports the last step's lr."""

    params: LRDParams
    cohort_safe = True  # lr is a function of the step and of begin's round factor

    def begin(self, model: nn.Module, config: ConfigRecord, state: RecordDict) -> None:
        self.round_factor = float(cast(float, config.get(ROUND_FACTOR_KEY, 1.0)))
        self.step_decay = float(cast(float, config.get(STEP_DECAY_KEY, 1.0)))
        self.last_lr = 0.0

    def lr(self, step: int, base_lr: float) -> float:
        self.last_lr = scheduled_lr(base_lr, self.round_factor, self.step_decay, step)
        return self.last_lr

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        records, metrics = super().end(model, state, layout)
        return records, {**metrics, LAST_LR_KEY: self.last_lr}


STRATEGY = register("lrd2d", server=LRDServer, client=LRDHooks, params=LRDParams)
