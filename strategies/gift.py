"""GIFT: Gradient-Instructed Frequency Tuning of the number of local steps per round.

Chen et al., "GIFT: Towards Accurate and Efficient Federated Learning with
Gradient-Instructed Frequency Tuning", IEEE JSAC 41(4), 2023. Only the abstract was
available; this is the reference-code variant (the co-authors' MindSpore and Plato
implementations), spec: shared/specs/algorithms_a.md §4.

The server measures model-wide gradient consistency C (the mean over scalars of
|EMA Σ_i g_i| / EMA Σ_i |g_i|) from the clients' round updates, at no extra traffic. When
C has not fallen for W rounds, clients synchronise more often: local steps are halved
and the EMAs restart. The window is fixed (spec §3.3, shared with PAS); `window_rule`
keeps the reference code's `doubling` window (W doubles after every change) and the
`one_step` test as ablations. The opposite direction the abstract claims ("raise or lower
the frequency"), whose rule the codes lack, is on by default (our PROPOSAL, spec §4.3):
when C stays more than (1 + δ) above its low for W rounds in a row, local steps double
again (up to the initial value). `increase=false window_rule=doubling` is the reference
code's rule, our default until issue 35.

As metric grafting sees it (`fl.mechanisms`: `diagnosis`, `laws`): diagnosis = the global mean of
the consistent rate (`ConsistencyEMA`), action = the global sync period τ (the
`local-steps` key), law = `stall_detector` stall, then `divide_int` by ρ, rounded up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fl.common.checkpointable import checkpointable
from fl.mechanisms.diagnosis import (
    ConsistencyEMA,
    PlateauDetector,
    check_tuning_settings,
    stall_detector,
)
from fl.mechanisms.laws import divide_int
from fl.strategy.client import ClientHooks
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy


@dataclass
class GIFTParams:
    """Defaults from the reference code (MindSpore/Plato), warm-up from the spec's plan,
    the fixed window from spec §3.3, both directions from the abstract."""

    initial_steps: int = 64  # τ_0; conf/strategy/gift.yaml takes the run's local_steps
    min_steps: int = 1  # τ never falls below this
    ratio: float = 2.0  # ρ: τ ← ceil(τ / ρ) on a stall
    ema: float = 0.5  # θ of the consistency EMAs (MindSpore's default; Plato 0.99)
    window: int = 5  # W: rounds without C falling that count as a stall
    window_rule: str = "fixed"  # fixed | doubling (reference code) | one_step, spec §3.3
    window_growth: int = 2  # doubling only: W ← W · this after every change of τ
    warmup: int = 10  # r_0: no change of τ in rounds <= r_0
    increase: bool = True  # PROPOSAL (ours): also lengthen τ when C rises; false: reference
    increase_margin: float = 0.2  # δ of the increase rule

    def validate(self) -> None:
        if self.initial_steps < 1:
            raise ValueError(
                "strategy.initial_steps must be >= 1: GIFT tunes local steps, "
                "so run it with local_steps > 0"
            )
        if not 1 <= self.min_steps <= self.initial_steps:
            raise ValueError("strategy.min_steps must be in [1, initial_steps]")
        check_tuning_settings(
            self.ratio, self.ema, self.window, self.window_growth, self.warmup, self.window_rule
        )
        if self.increase_margin < 0:
            raise ValueError("strategy.increase_margin must be >= 0")


@checkpointable
@dataclass
class FrequencyState:
    """The controller: local steps τ, the consistency EMAs and the stall detector."""

    steps: int
    ema: ConsistencyEMA
    detector: PlateauDetector
    above: int = 0  # consecutive rounds with C > (1 + δ) · low (increase rule)
    changes: list[tuple[int, int]] = field(default_factory=list)  # (round, new τ)

    @classmethod
    def fresh(cls, numel: int, params: GIFTParams) -> FrequencyState:
        detector = stall_detector(
            1, params.window_rule, params.window, growth=params.window_growth, warmup=params.warmup
        )
        return cls(params.initial_steps, ConsistencyEMA.zeros(numel, params.ema), detector)


def tune_frequency(
    state: FrequencyState, value: float, server_round: int, params: GIFTParams
) -> int:
    """Feed this round's consistency C to the rule; return τ for the next round."""
    c = torch.tensor([value])
    low = float(state.detector.low[0])
    state.above = state.above + 1 if c.item() > (1 + params.increase_margin) * low else 0
    window = int(state.detector.window[0])
    if (
        params.increase
        and state.above >= max(window, 1)
        and state.steps < params.initial_steps
        and server_round > params.warmup
    ):
        state.detector.restart(torch.ones(1, dtype=torch.bool), server_round)
        _change(
            state, min(params.initial_steps, math.ceil(state.steps * params.ratio)), server_round
        )
        return state.steps
    eligible = torch.tensor([state.steps > params.min_steps])
    if bool(state.detector.step(c, server_round, eligible)[0]):
        _change(
            state,
            divide_int(state.steps, params.ratio, params.min_steps, round_up=True),
            server_round,
        )
    return state.steps


def _change(state: FrequencyState, steps: int, server_round: int) -> None:
    state.steps = steps
    state.above = 0
    state.ema.reset()
    state.changes.append((server_round, steps))


class GIFTServer(ServerStrategy):
    """FedAvg whose clients get the current τ as `local-steps`; τ tuned after aggregation."""

    dpsgd_safe = False  # sets local-steps per round, which DP-SGD's plan does not follow

    params: GIFTParams
    state_attributes = ("frequency", "round_steps", "consistency")

    def __init__(self, params: GIFTParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.frequency: FrequencyState | None = None
        self.round_steps = params.initial_steps  # τ of the round just aggregated
        self.consistency = math.nan

    def on_round_start(self, server_round: int) -> None:
        if self.frequency is None:
            self.frequency = FrequencyState.fresh(self.global_vector.numel(), self.params)
        self.round_steps = self.frequency.steps

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        assert self.frequency is not None
        return {"local-steps": self.frequency.steps}

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        assert self.frequency is not None
        deltas = torch.stack([u.vector - self.global_vector for u in updates])
        self.consistency = float(self.frequency.ema.update(deltas).mean())
        tune_frequency(self.frequency, self.consistency, server_round, self.params)
        return super().aggregate(server_round, updates)

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        out["consistency"] = self.consistency
        out["local_steps"] = self.round_steps
        if self.frequency is not None:
            out["next_local_steps"] = self.frequency.steps
            out["sync_window"] = int(self.frequency.detector.window[0])
        return out


STRATEGY = register("gift", server=GIFTServer, client=ClientHooks, params=GIFTParams)
