"""PAS: Parameter-Adaptive Synchronization, a synchronisation period for every scalar.

Gan et al., "PAS: Towards Accurate and Efficient Federated Learning with
Parameter-Adaptive Synchronization", IWQoS 2024. Spec: shared/specs/algorithms_a.md §3.

Every scalar x has a period τ[x] (local steps); a round lasts τ̂ = max τ steps. A client
stops recording updates of x after step τ[x] (rolled back to its value then), so each
scalar is sent once per round, as in FedAvg, but the group of scalars sharing a period
can leave as soon as that period ends and its upload overlaps the remaining steps
(`client_seconds`). The server averages per scalar, tracks each scalar's consistency
R = |P + N| / (P - N) with bilateral EMAs, and divides τ[x] by γ when R[x] stops falling:
W rounds without R[x] falling below an earlier value (spec §3.3's fixed window; the paper
gives no exact test), after which that scalar's minimum and EMAs restart, so a period can
halve every W rounds. Ablations (`window_rule`): `doubling`, GIFT's reference code (no new
low for more than W rounds, W doubling per halving; with `warmup=5` our default until
issue 35), and `one_step` (R did not fall since last round).

Wire protocol (ours; in the paper each client applies the same halvings itself): the
periods travel through the shared sync protocol (`fl.wire.sync`) as control state. A client
that replied last round gets only the indices of the scalars halved since (4 B each; it
halves them itself), a returning client the periods changed since the round it last saw,
a new one those that differ from τ_0; the whole period vector (2 B each) only when that
is cheaper. The model travels dense. Replies carry one array per period group
(`fl.wire.codec`'s `grouped`), smallest period first.

As metric grafting sees it (`fl.mechanisms`: `diagnosis`, `actions`, `laws`): diagnosis = the
per-scalar consistent rate (`ConsistencyEMA`), action = per-scalar periods
(`shorten_periods`, `PeriodGroups`), law = `stall_detector` stall, then `divide` by γ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from torch import nn

from fl.common.checkpointable import checkpointable
from fl.mechanisms.actions import (
    PeriodGroups,
    group_sizes,
    period_upload_parts,
    periods_synced,
    shorten_periods,
    shortest_period,
)
from fl.mechanisms.diagnosis import (
    ConsistencyEMA,
    PlateauDetector,
    check_tuning_settings,
    stall_detector,
)
from fl.strategy.client import ClientHooks, Reply
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy, UploadParts
from fl.wire.codec import decode, encode_grouped
from fl.wire.records import Layout
from fl.wire.sync import SyncClient, Synced


@dataclass
class PASParams:
    """Defaults from the paper (S-PAS §VI-A); the stall test from spec §3.3 (fixed window)."""

    initial_period: int = 200  # τ_0; conf/strategy/pas.yaml takes the run's local_steps
    levels: int = 4  # times a period may shrink: 200 → 100 → 50 → 25 → 12 = τ_min
    ratio: float = 2.0  # γ: τ[x] ← max(τ_min, floor(τ[x] / γ))
    ema: float = 0.9  # θ of the bilateral EMAs
    window: int = 5  # W: rounds without R[x] falling that count as a stall
    window_rule: str = "fixed"  # fixed | doubling | one_step (ablations), spec §3.3
    window_growth: int = 2  # doubling only: W[x] ← W[x] · this after each halving
    warmup: int = 0  # no halving in rounds <= warmup (the fixed window needs none)

    @property
    def min_period(self) -> int:
        """τ_min: τ_0 divided by γ `levels` times (scale-free, so presets can scale τ_0)."""
        return shortest_period(self.initial_period, self.ratio, self.levels)

    def validate(self) -> None:
        if self.initial_period < 1:
            raise ValueError(
                "strategy.initial_period must be >= 1: it is the run's local_steps, "
                "so run PAS with local_steps > 0"
            )
        if self.levels < 0:
            raise ValueError("strategy.levels must be >= 0")
        if self.initial_period > np.iinfo(np.int16).max:
            raise ValueError("strategy.initial_period must fit in int16 (<= 32767)")
        check_tuning_settings(
            self.ratio, self.ema, self.window, self.window_growth, self.warmup, self.window_rule
        )


def shorten(periods: torch.Tensor, where: torch.Tensor, params: PASParams) -> torch.Tensor:
    """τ[x] ← max(τ_min, floor(τ[x] / γ)) for the scalars in `where` (mask or indices),
    in place; returns `periods`."""
    return shorten_periods(periods, where, params.ratio, params.min_period)


def synced_state(params: PASParams) -> tuple[Synced, ...]:
    """The periods, kept in step on every client (`fl.wire.sync`): τ_0 to start with, halved by
    the same rule on both sides."""
    return (periods_synced(params.initial_period, lambda p, index: shorten(p, index, params)),)


@checkpointable
@dataclass
class PeriodState:
    """Server-side controller: periods, bilateral EMAs, per-scalar stall detectors."""

    periods: torch.Tensor  # int64 τ per scalar
    ema: ConsistencyEMA
    detector: PlateauDetector

    @classmethod
    def fresh(cls, numel: int, params: PASParams) -> PeriodState:
        return cls(
            torch.full((numel,), params.initial_period, dtype=torch.int64),
            ConsistencyEMA.zeros(numel, params.ema),
            stall_detector(
                numel,
                params.window_rule,
                params.window,
                growth=params.window_growth,
                warmup=params.warmup,
            ),
        )


def tune_periods(
    state: PeriodState, deltas: torch.Tensor, server_round: int, params: PASParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one round's (clients, scalars) updates in; halve stalled periods.

    Returns (R per scalar, mask of the scalars whose period was halved).
    """
    rate = state.ema.update(deltas)
    stalled = state.detector.step(rate, server_round, state.periods > params.min_period)
    shorten(state.periods, stalled, params)
    state.ema.reset(stalled)
    return rate, stalled


# ----- server half ----------------------------------------------------------------------
class PASServer(ServerStrategy):
    """FedAvg per scalar; per-scalar periods tuned after aggregation; overlap credited."""

    dpsgd_safe = False  # sets local-steps per round, which DP-SGD's plan does not follow
    stale_replies_ok = False  # a reply's groups follow the periods of the round it answers

    params: PASParams
    state_attributes = ("control", "shortened", "consistency")

    def __init__(self, params: PASParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.control: PeriodState | None = None
        self.round_periods = torch.empty(0, dtype=torch.int64)  # τ of this round
        self.shortened = 0  # scalars halved in the last round
        self.consistency = float("nan")

    def sync_specs(self) -> tuple[Synced, ...]:
        return synced_state(self.params)

    def on_round_start(self, server_round: int) -> None:
        if self.control is None:
            self.control = PeriodState.fresh(self.global_vector.numel(), self.params)
        self.round_periods = self.control.periods.clone()

    def synced(self) -> dict[str, torch.Tensor]:
        return {"periods": self.round_periods}

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        return {"local-steps": int(self.round_periods.max())}

    def decode_reply(self, reply: Message, base: torch.Tensor) -> torch.Tensor:
        assert self.layout is not None
        return decode(reply.content, self.layout, groups=self.round_periods)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        assert self.control is not None
        deltas = torch.stack([u.vector - self.global_vector for u in updates])
        rate, stalled = tune_periods(self.control, deltas, server_round, self.params)
        self.consistency = float(rate.mean())
        self.shortened = int(stalled.sum())
        return super().aggregate(server_round, updates)

    def upload_parts(self, node_id: int, up_bytes: int) -> UploadParts:
        """Each group leaves as its period ends (from the periods the server sent, never
        the client's own account); any control bytes follow the last group."""
        return period_upload_parts(self.round_periods, up_bytes)

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        out["consistency"] = self.consistency
        if len(self.round_periods):
            out["local_steps"] = int(self.round_periods.max())
            out["mean_period"] = float(self.round_periods.float().mean())
            out["period_histogram"] = {str(p): n for p, n in group_sizes(self.round_periods)}
            out["shortened"] = self.shortened
        return out


# ----- client half ----------------------------------------------------------------------
class PASHooks(ClientHooks):
    """Keeps the periods in sync, rolls each group back after its period, sends groups."""

    params: PASParams

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        periods = SyncClient(synced_state(self.params)).receive(content, state, layout)["periods"]
        layout.load_into(model, decode(content, layout))
        self.layout, self.periods = layout, periods
        self.groups = PeriodGroups(layout, periods)

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
        self.groups.after_step(step, model)
        return True

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        return encode_grouped(layout.read(model), self.periods), {}


STRATEGY = register("pas", server=PASServer, client=PASHooks, params=PASParams)
