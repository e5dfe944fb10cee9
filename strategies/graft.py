"""Metric grafting: any diagnosis drives any action through a named control law.

Our reconstruction of the study design of Zhang et al., "Boosting Gradient-based Training
Diagnosis for Efficient and Accurate Federated Learning" (TMC 2026): only its abstract
is known (spec algorithms_b.md §4.1: a graft keeps its original's action and law in its
own units), so the metric catalogue, the grafts, SDMA/MDMA and the mapping below are
OUR design (spec §4.3), not the paper's.

`strategy.action` names one action or several joined by `+` (`fl.mechanisms.actions`: period,
scalar_period, freeze, bits, sparsity, lr); `strategy.diagnosis` names one diagnosis
(`fl.mechanisms.diagnosis`: loss, consistency, stepping, oscillation, relevance, significance) that
drives them all (SDMA when there are several actions), or one per action in the same
order (MDMA); `strategy.monitor` adds diagnoses that are only logged (`action=none`:
FedAvg with every metric logged, the oracle's base run). Each diagnosis is observed
once per round, after aggregation, and logged as `diagnosis_<name>` (its global mean).

Laws (`fl.mechanisms.laws`). A graft keeps its original's action and law in the
original's own units (spec §4.1); only the metric fed to the law changes:
- `ratio` (AdaComm, AdaQuantFL), for period / bits / sparsity / lr, in the loss ratio's
  units q_k: the loss ratio F_k / F_1 itself, or for a grafted diagnosis m its
  `gap_ratio` (m_k - m_*) / (m_1 - m_*), m_* the value where m's own original calls
  training settled (`settled_value`: APF's T_s 0.05, FedSU's T_R 0.01, CMFL's 0.7, Gaia's
  0, and the 0.1 at which PAS's analysis sees gradients counteract). The
  loss ratio is the same gap with F settled at 0, so each diagnosis moves the knob across
  the whole range as it travels its own: τ = ceil(q^e τ_0) down to `min_steps`; bits =
  the narrowest codec width holding q^-e b_0, from b_0 up to 32; top-k share = q^-e f_0;
  lr scale = q^e (e = `exponent`, 0.5 in both papers). Widths are 2, 4 (packed codes),
  8, 16 and 32 bits, so b_0 = 4 is served at 4 bits. (Before issue 35 the law read
  m_k / m_1, which left consistency-driven grafts almost inert.)
- `plateau` (GIFT), for the same actions: a stall (no new low for W rounds,
  `PlateauDetector`) divides τ and the lr scale by ρ, widens bits one step and
  multiplies the top-k share by ρ. Any monotone rescaling gives the same decisions.
- `freeze` always uses APF's law: per-scalar value < T_s, then AIMD lengths, and T_s
  halved at every check that leaves more than `tighten_above` (0.8) of the scalars
  frozen; `scalar_period` uses PAS's (per-scalar stall, τ[x] / γ). Both need a per-scalar
  diagnosis; every per-scalar diagnosis lies in [0, 1] like APF's stepping rate, so it is
  used as is.
Each smoothed diagnosis keeps its original's EMA weight (APF 0.99, FedSU 0.99, PAS 0.9)
unless `smoothing` sets one for all.
Precedence (MDMA): freezing is decided first, the other actions' diagnoses are pooled
over the scalars left unfrozen, and bits and top-k apply to the unfrozen payload.
AdaComm and AdaQuantFL are the presets conf/strategy/adacomm.yaml and adaquantfl.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Message, RecordDict
from torch import nn

from fl.common.checkpointable import checkpointable
from fl.mechanisms.actions import (
    BIT_WIDTHS,
    FreezeMask,
    GlobalSetting,
    PeriodGroups,
    bit_width,
    decode_update,
    encode_update,
    freezing_synced,
    period_upload_parts,
    periods_synced,
    shorten_periods,
    shortest_period,
)
from fl.mechanisms.diagnosis import (
    DIAGNOSES,
    PlateauDetector,
    RoundView,
    check_tuning_settings,
    make_diagnosis,
    pool,
    settled_value,
)
from fl.mechanisms.laws import below, divide_int, gap_ratio, ratio_law
from fl.strategy.client import ClientHooks, Reply
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy, UploadParts
from fl.wire.masking import Rollback
from fl.wire.records import Layout
from fl.wire.sync import SyncClient, Synced

# in precedence order: freezing first, then periods, then what shapes the payload
ACTIONS = ("freeze", "scalar_period", "period", "sparsity", "bits", "lr")
PER_SCALAR_ACTIONS = ("freeze", "scalar_period")
LAWS = ("ratio", "plateau")


@dataclass
class GraftParams:
    """Defaults: AdaComm's exponent, GIFT's plateau knobs, APF's threshold, PAS's γ."""

    diagnosis: str = "consistency"  # one name (SDMA) or one per action, joined by "+" (MDMA)
    action: str = "period"  # one or more of ACTIONS, joined by "+"; none: only observe
    monitor: str = ""  # more diagnoses, "+"-joined, observed and logged but driving nothing
    law: str = "ratio"  # ratio | plateau: the law of the global actions
    smoothing: float | None = None  # EMA weight for all smoothed diagnoses; None: originals'
    exponent: float = 0.5  # e of the ratio law
    initial_steps: int = 8  # τ_0 (conf/strategy/graft.yaml: the run's local_steps)
    min_steps: int = 1
    initial_bits: float = 4.0  # b_0: bits demanded at the start (served by the 4-bit codec)
    initial_fraction: float = 0.25  # f_0: top-k share at the start
    min_lr_scale: float = 0.1
    ratio: float = 2.0  # ρ / γ of the plateau laws
    window: int = 5  # W of the stall test
    window_growth: int = 2
    warmup: int = 5
    threshold: float = 0.05  # T_s of the freezing law
    tighten_above: float = 0.8  # halve T_s while more than this fraction is frozen (APF)
    levels: int = 3  # scalar_period: times a period may shrink

    @property
    def actions(self) -> tuple[str, ...]:
        return () if self.action == "none" else tuple(self.action.split("+"))

    @property
    def observed(self) -> list[str]:
        """Every diagnosis to compute each round (driving or monitored), each once."""
        names = [*self.diagnoses.values(), *(self.monitor.split("+") if self.monitor else [])]
        return sorted(set(names))

    @property
    def diagnoses(self) -> dict[str, str]:
        """action -> the diagnosis that drives it."""
        names = self.diagnosis.split("+")
        return {a: names[0] if len(names) == 1 else names[i] for i, a in enumerate(self.actions)}

    def validate(self) -> None:
        actions, names = self.actions, self.diagnosis.split("+")
        if [a for a in actions if a not in ACTIONS] or len(set(actions)) < len(actions):
            raise ValueError(f"strategy.action={self.action}: each once, of none or {ACTIONS}")
        if len(names) not in (1, len(actions)):
            raise ValueError("strategy.diagnosis: one name, or one per action joined by '+'")
        if bad := [n for n in [*names, *self.observed] if n not in DIAGNOSES]:
            raise ValueError(f"strategy.diagnosis: unknown {bad}; known: {sorted(DIAGNOSES)}")
        for action, name in self.diagnoses.items():
            if action in PER_SCALAR_ACTIONS and not DIAGNOSES[name][1]:
                raise ValueError(f"strategy.action={action} needs a per-scalar diagnosis")
        for pair in (("freeze", "scalar_period"), ("period", "scalar_period")):
            if set(pair) <= set(actions):
                raise ValueError(f"strategy.action: {pair[0]} and {pair[1]} exclude each other")
        if "scalar_period" in actions and "sparsity" in actions:
            raise ValueError("strategy.action: scalar_period sends period groups, not top-k")
        if self.law not in LAWS:
            raise ValueError(f"strategy.law must be one of {LAWS}")
        if self.initial_steps < 1 or not 1 <= self.min_steps <= self.initial_steps:
            raise ValueError("strategy.initial_steps >= min_steps >= 1 (run with local_steps > 0)")
        if not 0 < self.initial_bits <= max(BIT_WIDTHS):
            raise ValueError(f"strategy.initial_bits must be in (0, {max(BIT_WIDTHS)}]")
        if not 0 < self.initial_fraction <= 1 or not 0 < self.min_lr_scale <= 1:
            raise ValueError("strategy.initial_fraction and min_lr_scale must be in (0, 1]")
        check_tuning_settings(self.ratio, 0.0, self.window, self.window_growth, self.warmup)
        if self.smoothing is not None and not 0 <= self.smoothing < 1:
            raise ValueError("strategy.smoothing must be in [0, 1) or null (originals')")
        if self.threshold <= 0 or not 0 < self.tighten_above <= 1:
            raise ValueError("strategy.threshold must be > 0 and tighten_above in (0, 1]")


@checkpointable
@dataclass
class GraftState:
    """Everything the controller carries across rounds (checkpointed)."""

    diagnoses: dict[str, Any]  # name -> Diagnosis
    first: dict[str, float]  # action -> its metric's first pooled value (ratio law)
    settings: dict[str, GlobalSetting]  # global actions
    stalls: dict[str, PlateauDetector]  # global actions under the plateau law
    freeze: FreezeMask | None = None
    periods: torch.Tensor | None = None  # scalar_period: τ[x]
    period_stalls: PlateauDetector | None = None
    moves: list[tuple[int, str, float]] = field(default_factory=list)  # (round, action, new)
    threshold: float = 0.0  # freeze: the current T_s (tightened as APF does)


def fresh_state(params: GraftParams, numel: int) -> GraftState:
    """No history: every action at its start value."""
    starts = {
        "period": (params.initial_steps, params.min_steps, params.initial_steps),
        "bits": (params.initial_bits, 1, max(BIT_WIDTHS)),
        "sparsity": (params.initial_fraction, params.initial_fraction, 1.0),
        "lr": (1.0, params.min_lr_scale, 1.0),
    }
    actions = params.actions
    state = GraftState(
        {n: make_diagnosis(n, numel, params.smoothing) for n in params.observed},
        {},
        {a: GlobalSetting.at(*starts[a]) for a in actions if a in starts},  # bits: below
        {
            a: PlateauDetector.fresh(
                1, params.window, growth=params.window_growth, warmup=params.warmup
            )
            for a in actions
            if a in starts and params.law == "plateau"
        },
    )
    if "bits" in state.settings:  # the setting is a codec width, its start the demand b_0
        state.settings["bits"].value = bit_width(params.initial_bits)
    if "freeze" in actions:
        state.freeze = FreezeMask.none_frozen(numel)
        state.threshold = params.threshold
    if "scalar_period" in actions:
        state.periods = torch.full((numel,), params.initial_steps, dtype=torch.int64)
        state.period_stalls = PlateauDetector.fresh(
            numel, params.window, growth=params.window_growth, warmup=params.warmup
        )
    return state


def _min_period(params: GraftParams) -> int:
    return shortest_period(params.initial_steps, params.ratio, params.levels)


def _stalled(setting: str, value: float, state: GraftState, server_round: int) -> bool:
    detector = state.stalls[setting]
    return bool(detector.step(torch.tensor([value]), server_round)[0])


def steer(
    state: GraftState, params: GraftParams, values: dict[str, torch.Tensor], view: RoundView
) -> None:
    """Move every action from this round's diagnosis values, in precedence order."""
    active = view.where
    if state.freeze is not None:  # first: the other actions see only the unfrozen part
        stable = below(values[params.diagnoses["freeze"]][active], state.threshold)
        state.freeze.step(stable)
        active = state.freeze.active
        if 1 - active.float().mean().item() > params.tighten_above:
            state.threshold /= 2
    pooled_view = RoundView(**{**vars(view), "active": active})
    if state.periods is not None and state.period_stalls is not None:
        metric = values[params.diagnoses["scalar_period"]]
        eligible = state.periods > _min_period(params)
        stalled = state.period_stalls.step(metric, view.server_round, eligible)
        shorten_periods(state.periods, stalled, params.ratio, _min_period(params))
    for action, setting in state.settings.items():
        name = params.diagnoses[action]
        value = float(pool(values[name], "global", pooled_view)[0])
        settled = settled_value(name)
        new = _next_setting(action, setting, value, settled, state, params, view.server_round)
        if setting.set(new):
            state.moves.append((view.server_round, action, setting.value))


def _next_setting(
    action: str,
    setting: GlobalSetting,
    value: float,
    settled: float,
    state: GraftState,
    params: GraftParams,
    server_round: int,
) -> float:
    """The law's new value of one global action (`settled`: where its diagnosis says
    training is settled, in the diagnosis's units)."""
    e = params.exponent
    if params.law == "ratio":
        first = state.first.setdefault(action, value)
        relative = gap_ratio(value, first, settled)
        if action == "period":
            return ratio_law(relative, setting.start, e, setting.low, setting.high)
        if action == "bits":
            b0 = params.initial_bits
            demanded = ratio_law(relative, b0, -e, b0, max(BIT_WIDTHS), whole=False)
            return bit_width(demanded)
        return ratio_law(
            relative,
            setting.start,
            e if action == "lr" else -e,
            setting.low,
            setting.high,
            whole=False,
        )
    if not _stalled(action, value, state, server_round):
        return setting.value
    if action == "period":
        return divide_int(int(setting.value), params.ratio, params.min_steps, round_up=True)
    if action == "bits":
        return min((w for w in BIT_WIDTHS if w > setting.value), default=setting.value)
    return setting.value * (params.ratio if action == "sparsity" else 1 / params.ratio)


def synced_state(params: GraftParams) -> tuple[Synced, ...]:
    """What clients keep in step with the server: model and mask (freeze), or the
    per-scalar periods (scalar_period), or nothing."""
    if "freeze" in params.actions:
        return freezing_synced(False)
    if "scalar_period" in params.actions:
        floor = _min_period(params)
        advance = lambda p, index: shorten_periods(p, index, params.ratio, floor)  # noqa: E731
        return (periods_synced(params.initial_steps, advance),)
    return ()


class GraftServer(ServerStrategy):
    """FedAvg of client updates; after each round the diagnoses steer the actions."""

    central_dp_safe = False  # frozen scalars are never resent
    dpsgd_safe = False  # sets local-steps per round
    stale_replies_ok = False  # a reply follows the mask / periods of the round it answers

    params: GraftParams
    state_attributes = ("graft", "values")

    def __init__(self, params: GraftParams, **kwargs: Any) -> None:
        self.graft: GraftState | None = None
        self.values: dict[str, float] = {}  # pooled diagnosis values of the last round
        super().__init__(params, **kwargs)
        self.round_periods = torch.empty(0, dtype=torch.int64)

    def sync_specs(self) -> tuple[Synced, ...]:
        return synced_state(self.params)

    def on_round_start(self, server_round: int) -> None:
        if self.graft is None:
            self.graft = fresh_state(self.params, self.global_vector.numel())
        if self.graft.periods is not None:
            self.round_periods = self.graft.periods.clone()

    def synced(self) -> dict[str, torch.Tensor]:
        assert self.graft is not None
        if self.graft.freeze is not None:
            return {"model": self.global_vector, "mask": self.graft.freeze.active}
        return {"periods": self.round_periods}

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        assert self.graft is not None
        settings, out = self.graft.settings, dict[str, Any]()
        if "period" in settings:
            out["local-steps"] = int(settings["period"].value)
        if self.graft.periods is not None:
            out["local-steps"] = int(self.round_periods.max())
        if "bits" in settings:
            out["graft-bits"] = int(settings["bits"].value)
        if "sparsity" in settings:
            out["graft-fraction"] = float(settings["sparsity"].value)
        if "lr" in settings:
            out["graft-lr-scale"] = float(settings["lr"].value)
        return out

    def _mask(self) -> torch.Tensor | None:
        assert self.graft is not None
        return self.graft.freeze.active if self.graft.freeze is not None else None

    def decode_reply(self, reply: Message, base: torch.Tensor) -> torch.Tensor:
        assert self.layout is not None and self.graft is not None
        groups = self.round_periods if self.graft.periods is not None else None
        return base + decode_update(reply.content, self.layout, mask=self._mask(), groups=groups)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        assert self.graft is not None and self.layout is not None
        vector = super().aggregate(server_round, updates)
        mask = self._mask()
        if mask is not None:
            vector[~mask] = self.global_vector[~mask]  # exact, not a float round trip
        view = RoundView(
            server_round,
            self.global_vector,
            vector,
            torch.stack([u.vector - self.global_vector for u in updates]),
            torch.tensor([float(u.metrics.get("train-loss", 0.0)) for u in updates]),
            torch.tensor([float(u.num_examples) for u in updates]),
            self.layout.sizes,
            None if mask is None else mask.clone(),
        )
        values = {n: d.observe(view) for n, d in self.graft.diagnoses.items()}
        self.values = {n: float(pool(v, "global", view)[0]) for n, v in values.items()}
        steer(self.graft, self.params, values, view)
        return vector

    def upload_parts(self, node_id: int, up_bytes: int) -> UploadParts:
        if self.graft is None or self.graft.periods is None:
            return super().upload_parts(node_id, up_bytes)
        bits = self.graft.settings["bits"].value if "bits" in self.graft.settings else 32
        return period_upload_parts(self.round_periods, up_bytes, bits / 8)

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        out.update({f"diagnosis_{n}": v for n, v in self.values.items()})
        if self.graft is None:
            return out
        names = {"period": "local_steps", "bits": "upload_bits", "sparsity": "topk_fraction"}
        for action, setting in self.graft.settings.items():
            out[names.get(action, "lr_scale")] = setting.value
        if self.graft.freeze is not None:
            out["frozen_fraction"] = float((~self.graft.freeze.active).float().mean())
            out["stability_threshold"] = self.graft.threshold
        if self.graft.periods is not None:
            out["mean_period"] = float(self.graft.periods.float().mean())
        return out


class GraftHooks(ClientHooks):
    """Applies the round's settings: synced mask or periods, lr scale, update encoding."""

    params: GraftParams

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        config = content.config_records["config"]
        self.bits = int(config.get("graft-bits", 32))  # type: ignore[arg-type]
        self.fraction = float(config.get("graft-fraction", 1.0))  # type: ignore[arg-type]
        self.lr_scale = float(config.get("graft-lr-scale", 1.0))  # type: ignore[arg-type]
        if self.bits not in BIT_WIDTHS or not 0 < self.fraction <= 1 or self.lr_scale <= 0:
            raise ValueError("graft settings out of range")
        self.mask: torch.Tensor | None = None
        self.groups: PeriodGroups | None = None
        self.rollback: Rollback | None = None
        actions = self.params.actions
        if "freeze" in actions:
            synced = SyncClient(freezing_synced(False)).receive(content, state, layout)
            vector, self.mask = synced["model"], synced["mask"]
            layout.load_into(model, vector)
            self.rollback = Rollback(model, layout, self.mask, vector)
        else:
            if "scalar_period" in actions:
                synced = SyncClient(synced_state(self.params)).receive(content, state, layout)
                periods = synced["periods"]
                self.groups = PeriodGroups(layout, periods)
            super().load(model, content, state, layout)
        self.start = layout.read(model)

    def lr(self, step: int, base_lr: float) -> float:
        return base_lr * self.lr_scale

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
        if self.rollback is not None:
            self.rollback()
        if self.groups is not None:
            self.groups.after_step(step, model)
        return True

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        delta = layout.read(model) - self.start
        groups = self.groups.periods if self.groups is not None else None
        payload = encode_update(
            delta, layout, bits=self.bits, fraction=self.fraction, mask=self.mask, groups=groups
        )
        return payload, {}


STRATEGY = register("graft", server=GraftServer, client=GraftHooks, params=GraftParams)
