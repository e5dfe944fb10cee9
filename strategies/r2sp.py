"""R2SP and FL-R2SP: groups push to the server in turn, evenly spaced in time.

R2SP: Chen, Wang, Li, "Round-Robin Synchronization: Mitigating Communication Bottlenecks
in Parameter Servers", INFOCOM 2019 (full text read; spec algorithms_b.md §2.1-2.4).
FL-R2SP: Zhang et al., ToN 2025 (paper unseen; the authors' prototype in chenc10/APF_Release
read; spec §2.5). Both run on `loop=groups`: a group is R2SP's worker (its members train
in parallel and their example-weighted mean is the group's model, the prototype's
intra-group BSP), and the groups' transfers share the server link on the virtual clock.

- Schedule (§2.2, `fl.mechanisms.roundrobin`): groups start in a fixed cyclic order, consecutive
  starts at least r·T/G apart (first cycle: offsets 0, r·T/G, 2·r·T/G, ...); T is an
  EMA of the groups' observed spans. The loop holds each group until its start time.
- Update (Alg. 1, Lemma 1): a group's update is applied when it lands, on the current
  global model and without a staleness discount (the cyclic order bounds staleness by
  G-1). FL-R2SP moves the global model by 1/G of it: W ← W + (1/G)·(m_g - W_g^start),
  with the spec's corrected delta (the model the group started from), not the
  prototype's m_g - m_g^prev.
- Heterogeneous batch sizes (§2.3, R2SP only): once every node's span has been measured
  after the first (warm-up) cycle, each node trains `b + v·idle/K` samples per step (idle:
  the slowest span minus its own, v its speed, K local steps), with the learning rate
  scaled by b/b_0 so that every sample weighs the same. Tuned once, as in Table II.

Our choices where the sources are silent: T is seeded with the first group's predicted
span when the server link is its alone; the EMA weight is the prototype's 0.9 for both;
FL-R2SP's grouping is the loop's (partition p in group p mod G), its relaxation the
prototype's 0.9, and it does not tune batch sizes (the spec's proposals for grouping,
deadlines and data-heterogeneity weights are not implemented); tuned batches are capped
at `max_batch_factor`·b_0; spans of the first cycle (the staggered warm-up) are not used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fl.mechanisms.roundrobin import RoundRobin
from fl.strategy.client import ClientHooks
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy

__all__ = ["FLR2SPParams", "R2SPParams", "R2SPServer", "tuned_batches"]


@dataclass
class R2SPParams:
    """R2SP's defaults (INFOCOM 2019); conf/strategy/r2sp.yaml takes the run's values."""

    relaxation: float = 0.8  # r: consecutive starts at least r·T/G apart (paper: 0.8)
    period_ema: float = 0.9  # weight of the old T (paper: not given; prototype: 0.9)
    scale_by_groups: bool = False  # FL-R2SP: move the global model by 1/G of an update
    tune_batches: bool = True  # §2.3: fill each node's idle time with larger batches
    batch_size: int = 32  # b_0, the default batch size (the run's batch_size)
    lr: float = 0.3  # η at b_0 (the run's lr); a tuned batch b trains at η·b/b_0
    local_steps: int = 0  # K (the run's local_steps); batch tuning needs K > 0
    max_batch_factor: float = 2.0  # ours: a tuned batch is at most this times b_0
    # false: no round-robin schedule, groups start whenever idle (the control arm that
    # separates the schedule's effect from the 1/G update rule; not in the papers)
    schedule: bool = True
    groups: int = 1  # G, the loop's groups (conf: ${loop.groups}), for the 1/G rule

    def validate(self) -> None:
        if not 0.0 <= self.relaxation <= 1.0:
            raise ValueError("strategy.relaxation must be in [0, 1]")
        if self.groups < 1:
            raise ValueError("strategy.groups (loop.groups) must be >= 1")
        if not 0.0 <= self.period_ema < 1.0:
            raise ValueError("strategy.period_ema must be in [0, 1)")
        if self.batch_size < 1 or not self.lr > 0 or not self.max_batch_factor >= 1:
            raise ValueError(
                "strategy.batch_size must be >= 1, strategy.lr > 0, strategy.max_batch_factor >= 1"
            )
        if self.tune_batches and self.local_steps < 1:
            raise ValueError(
                "strategy.tune_batches needs local_steps > 0 (with local_epochs a batch size "
                "does not change a round's work); set local_steps or strategy.tune_batches=false"
            )


@dataclass
class FLR2SPParams(R2SPParams):
    """FL-R2SP's defaults: the authors' FL prototype (relaxation 0.9, 1/G scaling)."""

    relaxation: float = 0.9
    scale_by_groups: bool = True
    tune_batches: bool = False


def tuned_batches(
    spans: Mapping[int, float], speeds: Mapping[int, float], batch: int, steps: int, cap: int
) -> dict[int, int]:
    """§2.3: each node's batch grows by the samples that fill its idle time.

    x_new = x + v·idle per iteration (Table II: 512 + 0.62 s · 628/s = 901), here spread
    over `steps` local steps; idle is the slowest span minus the node's own.
    """
    slowest = max(spans.values())
    return {
        node: min(cap, batch + round(speeds[node] * (slowest - span) / steps))
        for node, span in spans.items()
    }


class R2SPServer(ServerStrategy):
    """Groups started in turn (the loop holds them), updates applied as groups land."""

    params: R2SPParams
    loop_kinds = ("groups",)  # R2SP schedules the groups loop's group starts
    dpsgd_safe = False  # tuned batch sizes differ per node; DP-SGD assumes the run's
    state_attributes = ("spans", "batches")
    nan_sentinels = ("spans",)  # NaN: a span still to be measured

    def __init__(self, params: R2SPParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.schedule = RoundRobin(params.relaxation, params.period_ema)
        self.spans: dict[int, float] = {}  # node -> measured span (nan: not yet), until tuned
        self.batches: dict[int, int] = {}  # node -> tuned batch size; empty: not tuned

    def group_schedule(self) -> RoundRobin | None:
        return self.schedule if self.params.schedule else None

    @property
    def update_scale(self) -> float:
        """How far a group's update moves the global model: all of it, or 1/G (FL-R2SP)."""
        return 1.0 / self.params.groups if self.params.scale_by_groups else 1.0

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        if self.params.tune_batches and not self.batches:
            self.spans.setdefault(node_id, math.nan)  # to be measured before tuning
        batch = self.batches.get(node_id)
        if batch is None:
            return {}
        return {"batch-size": batch, "lr": self.params.lr * batch / self.params.batch_size}

    def rebase(self, delta: torch.Tensor, staleness: int) -> torch.Tensor:
        """R2SP applies an update as pushed (ω ← ω + u): no staleness discount."""
        return self.global_vector + delta

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        """The group's mean model, as a step from the current global scaled by update_scale."""
        if self.params.tune_batches and not self.batches:
            self._measure(updates)
        group_model = super().aggregate(server_round, updates)
        return self.global_vector + self.update_scale * (group_model - self.global_vector)

    def _measure(self, updates: list[ClientUpdate]) -> None:
        """Record spans after the warm-up cycle; tune once every asked node has one."""
        for update in updates:
            info = self.reply_info.get(update.node_id)
            if info is not None and info.sent_round > 1:
                self.spans[update.node_id] = info.arrived_s - info.sent_s
        if self.spans and all(math.isfinite(s) for s in self.spans.values()):
            speeds = {n: float(self.extra_config(n)["device-speed"]) for n in self.spans}
            params = self.params
            cap = int(params.max_batch_factor * params.batch_size)
            self.batches = tuned_batches(
                self.spans, speeds, params.batch_size, params.local_steps, cap
            )

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        if self.params.schedule:
            out["period_s"] = self.schedule.period_s
            out["gap_s"] = self.schedule.gap_s
        if self.batches:
            out["batch_mean"] = sum(self.batches.values()) / len(self.batches)
        return out


STRATEGY = register("r2sp", server=R2SPServer, client=ClientHooks, params=R2SPParams)
FL_STRATEGY = register("fl_r2sp", server=R2SPServer, client=ClientHooks, params=FLR2SPParams)
