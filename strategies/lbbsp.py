"""LB-BSP for FL: per-client batch sizes from measured throughput, global batch fixed.

Chen et al., SoCC 2020 / TCC 2023 (spec algorithms_b.md §3.3, FL variant of the TCC
version, seen only as a results figure; the rule is the spec's proposal). Every client
keeps the run's τ local steps; client i trains with batch B_i ∝ v̂_i, its predicted
throughput, so that all finish their compute together, while Σ B_i over the round's
clients stays the global batch BSP would use (Σ min(B_0, |D_i|)). Aggregation weighs each
client by the samples it processed, B_i·τ (the FL analogue of LB-BSP's batch-weighted
gradient), or by |D_i| (`weight_by: examples`, FedAvg's weights, less biased towards fast
clients on non-IID data).

Throughput is measured by the server, not told: on the virtual clock the compute span is
the clock's own (download end to training end, background load included; the reply's
`compute-s` is ignored); on real arrivals the server sees only the round trip, and the
client's `compute-s` is a hint held within [HINT_FLOOR × round trip, round trip] (our
choice: a client can overstate its speed at most 1/HINT_FLOOR-fold, and only relative to
its own observed round trip). v = samples / compute span feeds a per-client predictor
(`fl.mechanisms.lbbsp`: last value, EMA, NARX without load signals). A client not measured
yet is predicted at the mean of those that are; the first round is BSP.
The batch sizes reach the clients as the `batch-size` key, which the trainer hands to the
`batch_size` hook (and the clock charges); `predictor: none` keeps B_0 for everyone: BSP
with the same weighting, the reference arm of `experiment=lbbsp`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from fl.mechanisms.lbbsp import PREDICTORS, Predictor, make_predictor, proportional_sizes
from fl.strategy.client import ClientHooks, Reply
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.records import Layout

__all__ = ["LBBSPHooks", "LBBSPParams", "LBBSPServer"]

WEIGHTS = ("samples", "examples")
HINT_FLOOR = 0.5  # real arrivals: a reported compute time counts as at least this share of
# the round trip the server saw (the spec has no rule; ours bounds what a lie can buy)
CHOICES = ("none", *PREDICTORS)  # none: no balancing, every client B_0 (BSP)


@dataclass
class LBBSPParams:
    """The FL rule's settings; conf/strategy/lbbsp.yaml takes B_0 and τ from the run."""

    batch_size: int = 32  # B_0 (the run's batch_size)
    local_steps: int = 10  # τ (the run's local_steps); must be > 0
    predictor: str = "ema"  # none (B_0 for all: BSP) | last | ema | narx: v̂_i from throughputs
    ema_weight: float = 0.5  # the EMA's weight of the newest throughput
    weight_by: str = "samples"  # samples: B_i·τ (batch-weighted) | examples: |D_i| (FedAvg)
    min_batch: int = 1

    def validate(self) -> None:
        if self.local_steps < 1:
            raise ValueError(
                "strategy=lbbsp keeps τ local steps per client and sizes batches: set "
                "local_steps > 0 (with local_epochs a batch size does not change the work)"
            )
        if self.batch_size < self.min_batch or self.min_batch < 1:
            raise ValueError("strategy.batch_size must be >= strategy.min_batch >= 1")
        if self.predictor not in CHOICES:
            raise ValueError(f"strategy.predictor must be one of {CHOICES}")
        if self.weight_by not in WEIGHTS:
            raise ValueError(f"strategy.weight_by must be one of {WEIGHTS}")
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError("strategy.ema_weight must be in (0, 1]")


class LBBSPServer(ServerStrategy):
    """Sizes each selected client's batch before sending; weighs replies by their batch."""

    params: LBBSPParams
    dpsgd_safe = False  # batch sizes differ per node and round; DP-SGD assumes the run's
    state_attributes = ("predictors", "batches")

    def __init__(self, params: LBBSPParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.predictors: dict[int, Predictor] = {}  # node -> its throughput predictor
        self.batches: dict[int, int] = {}  # node -> batch of its latest instruction
        self.round_idle_s = math.nan  # mean barrier wait of the last round's replies

    def _cap(self, node: int) -> int | None:
        """The most samples a batch of this node can hold: its partition (server-known)."""
        bound = self.example_bounds.limit(node) if self.example_bounds else None
        return None if bound is None else max(bound, self.params.min_batch)

    def _speeds(self, nodes: Sequence[int]) -> list[float] | None:
        """Predicted throughputs of `nodes` (unmeasured ones at the measured mean); None
        while nothing is measured."""
        predicted = {n: self.predictors[n].predict() for n in nodes if n in self.predictors}
        known = [v for v in predicted.values() if v is not None and v > 0]
        if not known:
            return None
        mean = sum(known) / len(known)
        return [v if (v := predicted.get(n)) is not None and v > 0 else mean for n in nodes]

    def select(self, server_round: int, candidates: Sequence[int]) -> list[int]:
        """The seeded sample, then this round's batch sizes for it."""
        chosen = super().select(server_round, candidates)
        bounds = [self._cap(n) for n in chosen]
        even = [min(self.params.batch_size, b or self.params.batch_size) for b in bounds]
        speeds = self._speeds(chosen) if self.params.predictor != "none" else None
        sizes = even
        if speeds is not None:
            caps = [sum(even) if b is None else b for b in bounds]
            sizes = proportional_sizes(speeds, sum(even), caps, self.params.min_batch)
        self.batches.update(zip(chosen, sizes, strict=True))
        return chosen

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        return {"batch-size": self.batches[node_id]}

    def check_update(self, update: ClientUpdate) -> ClientUpdate:
        """The compute span throughput is measured from: the clock's where there is one,
        else the reply's positive, finite `compute-s` held within the round trip's bounds."""
        info = self.reply_info.get(update.node_id)
        if info is not None and info.compute_s is not None and info.compute_s > 0:
            update.metrics["compute-s"] = info.compute_s  # observed: the report is ignored
            return update
        compute_s = update.metrics.get("compute-s")
        if not isinstance(compute_s, int | float) or not 0 < compute_s < math.inf:
            raise ValueError(f"'compute-s' must be a positive number, got {compute_s!r}")
        if info is not None and info.arrived_s > info.sent_s:
            round_trip = info.arrived_s - info.sent_s
            hint = min(max(float(compute_s), HINT_FLOOR * round_trip), round_trip)
            update.metrics["compute-s"] = hint
        return update

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        """Learn each reply's throughput; weigh by samples processed (≤ B_i·τ) or |D_i|."""
        for u in updates:
            samples = min(int(u.metrics.get("samples", 0)), self._asked(u.node_id))
            if samples > 0 and self.params.predictor != "none":
                predictor = self.predictors.setdefault(
                    u.node_id, make_predictor(self.params.predictor, self.params.ema_weight)
                )
                predictor.observe(samples / float(u.metrics["compute-s"]))
            if self.params.weight_by == "samples":
                u.num_examples = max(samples, 1)
        arrivals = [
            self.reply_info[u.node_id].arrived_s for u in updates if u.node_id in self.reply_info
        ]
        last = max(arrivals, default=math.nan)
        self.round_idle_s = (
            sum(last - a for a in arrivals) / len(arrivals) if arrivals else math.nan
        )
        return super().aggregate(server_round, updates)

    def _asked(self, node: int) -> int:
        return self.batches.get(node, self.params.batch_size) * self.params.local_steps

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        sizes = [self.batches[n] for n in self.stats.sent if n in self.batches]
        if sizes:
            out |= {"batch_min": min(sizes), "batch_max": max(sizes), "batch_total": sum(sizes)}
        out["idle_mean_s"] = self.round_idle_s
        return out


class LBBSPHooks(ClientHooks):
    """Reports the round's compute time: a hint the server uses, within bounds, only where
    no virtual clock shows it the span."""

    params: LBBSPParams

    def begin(self, model: nn.Module, config: ConfigRecord, state: RecordDict) -> None:
        self.started = time.perf_counter()

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        """Virtual compute seconds at this device's speed, or wall seconds without a clock."""
        speed = self.time.speed
        compute_s = self.time.samples / speed if math.isfinite(speed) else 0.0
        records, metrics = super().end(model, state, layout)
        wall_s = time.perf_counter() - self.started
        return records, {**metrics, "compute-s": compute_s if compute_s > 0 else wall_s}


STRATEGY = register("lbbsp", server=LBBSPServer, client=LBBSPHooks, params=LBBSPParams)
