"""PAS: Parameter-Adaptive Synchronization, a synchronisation period for every scalar.

Gan et al., "PAS: Towards Accurate and Efficient Federated Learning with
Parameter-Adaptive Synchronization", IWQoS 2024. Spec: shared/specs/algorithms_a.md §3.

Every scalar x has a period τ[x] (local steps); a round lasts τ̂ = max τ steps. A client
stops recording updates of x after step τ[x] (rolled back to its value then), so each
scalar is sent once per round, as in FedAvg, but the group of scalars sharing a period
can leave as soon as that period ends and its upload overlaps the remaining steps
(`client_seconds`). The server averages per scalar, tracks each scalar's consistency
R = |P + N| / (P - N) with bilateral EMAs, and divides τ[x] by γ when R[x] stops falling:
no new low for W rounds (our choice, from GIFT's reference code; the paper gives no
exact test), after which W doubles for that scalar and its EMAs restart.

Wire protocol (ours; in the paper each client applies the same halvings itself): a
client that replied last round gets only the indices of the scalars halved since
(4 B each, control traffic); any other client gets every period (2 B each), unless
all are still τ_0. Replies
carry one array per period group, smallest period first, and report the group sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from torch import nn

from fl.clock import ClientWork, DeviceProfile, pipelined_seconds, sequential_seconds
from fl.codec import CodecError, decode, with_control
from fl.diagnosis import ConsistencyEMA, PlateauDetector, check_tuning_settings
from fl.hooks import ClientHooks, Reply
from fl.masking import Rollback
from fl.records import Layout, array_to_numpy, numpy_to_array
from fl.registry import register
from fl.state import checkpointable
from fl.strategy import ClientUpdate, ServerStrategy

PERIODS, SHORTENED, STATE, SYNCED = "pas-periods", "pas-shortened", "pas", "pas-synced"


@dataclass
class PASParams:
    """Defaults from the paper (S-PAS §VI-A); the stall test and warm-up are ours."""

    initial_period: int = 200  # τ_0; conf/strategy/pas.yaml takes the run's local_steps
    levels: int = 4  # times a period may shrink: 200 → 100 → 50 → 25 → 12 = τ_min
    ratio: float = 2.0  # γ: τ[x] ← max(τ_min, floor(τ[x] / γ))
    ema: float = 0.9  # θ of the bilateral EMAs
    window: int = 5  # W: rounds without a new low of R[x] that count as a stall
    window_growth: int = 2  # W[x] ← W[x] · this after each halving (0 and 1: one-step test)
    warmup: int = 5  # no halving in rounds <= warmup

    @property
    def min_period(self) -> int:
        """τ_min: τ_0 divided by γ `levels` times (scale-free, so presets can scale τ_0)."""
        period = self.initial_period
        for _ in range(self.levels):
            period = max(1, int(period / self.ratio))
        return period

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
        check_tuning_settings(self.ratio, self.ema, self.window, self.window_growth, self.warmup)


def shorten(periods: torch.Tensor, where: torch.Tensor, params: PASParams) -> None:
    """τ[x] ← max(τ_min, floor(τ[x] / γ)) for the scalars in `where` (mask or indices)."""
    shorter = torch.floor(periods[where] / params.ratio).to(periods.dtype)
    periods[where] = shorter.clamp_min(params.min_period)


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
            PlateauDetector.fresh(
                numel, params.window, growth=params.window_growth, warmup=params.warmup
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


# ----- reply codec: one array per period group ------------------------------------------
def group_sizes(periods: torch.Tensor) -> list[tuple[int, int]]:
    """(period, number of scalars) for each distinct period, smallest first."""
    values, counts = torch.unique(periods, sorted=True, return_counts=True)
    return [(int(v), int(c)) for v, c in zip(values, counts, strict=True)]


def group_bytes(periods: torch.Tensor) -> list[tuple[int, int]]:
    """(period, float32 bytes) of each group of the reply, in sending order."""
    return [(period, 4 * n) for period, n in group_sizes(periods)]


def encode_groups(
    vector: torch.Tensor, periods: torch.Tensor
) -> dict[str, ArrayRecord | ConfigRecord]:
    """The reply payload: one array per period group, in sending order."""
    arrays = ArrayRecord()
    groups = group_bytes(periods)
    for period, _ in groups:
        arrays[f"p{period}"] = numpy_to_array(vector[periods == period].contiguous().numpy())
    total = sum(size for _, size in groups)
    codec = ConfigRecord({"name": "pas-groups", "payload-bytes": total, "control-bytes": 0})
    return {"arrays": arrays, "codec": codec}


def decode_groups(content: RecordDict, periods: torch.Tensor) -> torch.Tensor:
    """The full vector from a grouped reply; the groups must match `periods` exactly."""
    arrays = content.array_records.get("arrays")
    if arrays is None:
        raise CodecError("reply has no 'arrays' record")
    expected = {f"p{p}": n for p, n in group_sizes(periods)}
    if set(arrays) != set(expected):
        raise CodecError(f"reply groups {sorted(arrays)} do not match periods {sorted(expected)}")
    out = torch.empty(periods.numel())
    for key, n in expected.items():
        raw = array_to_numpy(arrays[key])
        if raw.dtype != np.float32 or raw.shape != (n,):
            raise CodecError(f"group {key} holds {raw.dtype} {raw.shape}, expected float32 ({n},)")
        out[periods == int(key[1:])] = torch.from_numpy(raw.copy())
    return out


def _periods_array(periods: torch.Tensor) -> Array:
    return numpy_to_array(periods.numpy().astype(np.int16))


# ----- server half ----------------------------------------------------------------------
class PASServer(ServerStrategy):
    """FedAvg per scalar; per-scalar periods tuned after aggregation; overlap credited."""

    dpsgd_safe = False  # sets local-steps per round, which DP-SGD's plan does not follow

    params: PASParams
    state_attributes = ("control", "shortened", "replied", "consistency")

    def __init__(self, params: PASParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.control: PeriodState | None = None
        self.round_periods = torch.empty(0, dtype=torch.int64)  # τ of this round
        self.shortened = torch.empty(0, dtype=torch.int64)  # indices halved last round
        self.replied: dict[int, int] = {}  # node -> last round it replied in
        self.consistency = float("nan")

    def on_round_start(self, server_round: int) -> None:
        if self.control is None:
            self.control = PeriodState.fresh(self.global_vector.numel(), self.params)
        self.round_periods = self.control.periods.clone()

    def _in_sync(self, server_round: int, node_id: int) -> bool:
        return self.replied.get(node_id) == server_round - 1

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        base = server_round - 1 if self._in_sync(server_round, node_id) else -1
        return {"local-steps": int(self.round_periods.max()), "pas-base-round": base}

    def train_payload(self, server_round: int, node_id: int) -> dict[str, Any]:
        payload = self._dense_payload
        if not self._in_sync(server_round, node_id):
            if bool((self.round_periods == self.params.initial_period).all()):
                return payload  # the client starts every scalar at τ_0 by itself
            control = ArrayRecord({"periods": _periods_array(self.round_periods)})
            return with_control(payload, PERIODS, control)
        if len(self.shortened):
            indices = numpy_to_array(self.shortened.numpy().astype(np.int32))
            return with_control(payload, SHORTENED, ArrayRecord({"indices": indices}))
        return payload

    def decode_reply(self, reply: Message) -> torch.Tensor:
        return decode_groups(reply.content, self.round_periods)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        assert self.control is not None
        deltas = torch.stack([u.vector - self.global_vector for u in updates])
        rate, stalled = tune_periods(self.control, deltas, server_round, self.params)
        self.consistency = float(rate.mean())
        self.shortened = stalled.nonzero().flatten()
        for update in updates:
            self.replied[update.node_id] = server_round
        return super().aggregate(server_round, updates)

    def client_seconds(self, profile: DeviceProfile, work: ClientWork) -> float:
        """Groups leave as their period ends: from the periods the server sent, never the
        client's own account (a client could otherwise shorten its time)."""
        groups = group_bytes(self.round_periods)
        if len(groups) <= 1:
            return sequential_seconds(profile, work)
        steps = int(self.round_periods.max())
        return pipelined_seconds(
            profile,
            down_bytes=work.down_bytes,
            step_seconds=work.samples / steps / profile.speed,
            groups=groups,
            extra_up_bytes=max(work.up_bytes - sum(size for _, size in groups), 0),
        )

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        out["consistency"] = self.consistency
        if len(self.round_periods):
            out["local_steps"] = int(self.round_periods.max())
            out["mean_period"] = float(self.round_periods.float().mean())
            out["period_histogram"] = {str(p): n for p, n in group_sizes(self.round_periods)}
            out["shortened"] = len(self.shortened)
        return out


# ----- client half ----------------------------------------------------------------------
class PASHooks(ClientHooks):
    """Keeps the periods in sync, rolls each group back after its period, sends groups."""

    params: PASParams

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        config = content.config_records["config"]
        base_round = cast(int, config["pas-base-round"])
        if PERIODS in content.array_records:
            stored = array_to_numpy(content.array_records[PERIODS]["periods"])
            periods = torch.from_numpy(stored.astype(np.int64))
        elif base_round < 0:  # no periods sent: all still at τ_0
            periods = torch.full((layout.numel,), self.params.initial_period, dtype=torch.int64)
        else:
            kept, synced = state.array_records.get(STATE), state.config_records.get(SYNCED)
            if kept is None or synced is None or synced["round"] != base_round:
                raise RuntimeError(f"PAS client is not in sync with round {base_round}")
            periods = torch.from_numpy(array_to_numpy(kept["periods"]).astype(np.int64))
            if SHORTENED in content.array_records:
                indices = array_to_numpy(content.array_records[SHORTENED]["indices"])
                shorten(periods, torch.from_numpy(indices.astype(np.int64)), self.params)
        vector = decode(content, layout)
        layout.load_into(model, vector)
        state[STATE] = ArrayRecord({"periods": _periods_array(periods)})
        state[SYNCED] = ConfigRecord({"round": cast(int, config["server-round"])})
        self.layout, self.periods = layout, periods
        self.boundaries = {p for p, _ in group_sizes(periods)[:-1]}  # all but the last group
        self.rollback: Rollback | None = None

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
        if self.rollback is not None:
            self.rollback()
        if step in self.boundaries:  # freeze this group at its current values from now on
            current = self.layout.flatten(model.state_dict())
            self.rollback = Rollback(model, self.layout, self.periods > step, current)
        return True

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        return encode_groups(layout.flatten(model.state_dict()), self.periods), {}


STRATEGY = register("pas", server=PASServer, client=PASHooks, params=PASParams)
