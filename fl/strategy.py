"""The server half of a strategy: Flower's FedAvg with per-node messages and checks.

What it adds to `flwr.serverapp.strategy.FedAvg`: seeded client selection among the
nodes the run says are reachable, one message per node (a strategy may give each
node its own config and payload), replies decoded through `fl.codec` and validated
before they can touch the global model, and `state_dict()` for resume. Subclasses
override the small methods below, never the round loop.

Nothing a client reports is trusted: its claimed example count is clipped to the bound
the server knows (`bound_examples`, set by the round loop from the partition sizes), an
update beyond `max_update_norm` is rejected or clipped (`update_norm_policy`), and the
aggregation rule is pluggable (`fl.robust.Aggregator`: mean, median, trimmed mean, Krum,
Multi-Krum, Bulyan), so one client cannot decide the global model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fl.clock import ClientWork, DeviceProfile, sequential_seconds
from fl.codec import CodecError, content_bytes, declared_traffic, decode, encode_dense
from fl.records import Layout, vector_to_arrays, wire_dtype
from fl.robust import NORM_POLICIES, Aggregator, ExampleBounds, median_claim

__all__ = ["ClientUpdate", "RoundStats", "ServerStrategy"]

log = logging.getLogger(__name__)
# Default reply size bound: any of our codecs (dense, masked + bitmap, values + indices,
# control state) stays within 4x the dense model; 1 MiB covers headers and metrics.
PAYLOAD_FACTOR, PAYLOAD_SLACK = 4, 2**20


@dataclass
class ClientUpdate:
    """One accepted reply: the client's full model vector and what it reported."""

    node_id: int
    vector: torch.Tensor
    num_examples: int
    metrics: dict[str, Any]


@dataclass
class RoundStats:
    """What happened to the replies of the last round."""

    sent: list[int] = field(default_factory=list)  # node ids asked to train
    accepted: int = 0
    failed: int = 0  # error replies (crashed ClientApps)
    rejected: int = 0  # replies that failed validation
    missing: list[int] = field(default_factory=list)  # node ids that never replied
    updates: list[ClientUpdate] = field(default_factory=list)  # the accepted replies
    reasons: list[str] = field(default_factory=list)
    examples_clipped: int = 0  # accepted replies whose num-examples claim was cut to the bound
    norm_clipped: int = 0  # accepted replies scaled down to max_update_norm (policy clip)
    skipped: bool = False  # too few replies for the aggregation rule: global model kept


class ServerStrategy(FedAvg):
    """Base of our server halves; plain FedAvg when nothing is overridden."""

    # Attributes a checkpoint saves and a resume restores; stateful strategies list theirs.
    state_attributes: ClassVar[tuple[str, ...]] = ()
    # Privacy wrappers check these (fl/config.py refuses the combination before round 1):
    # central DP's noise must reach every client's copy of the model; DP-SGD's accountant
    # assumes the run's own step count every round.
    central_dp_safe: ClassVar[bool] = True
    dpsgd_safe: ClassVar[bool] = True

    def __init__(
        self,
        params: Any,
        *,
        seed: int,
        clients_per_round: int,
        max_update_norm: float = math.inf,
        max_payload_bytes: float | None = None,
        aggregator: Aggregator | None = None,
        update_norm_policy: str = "reject",
    ) -> None:
        super().__init__(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
        if update_norm_policy not in NORM_POLICIES:
            raise ValueError(f"update_norm_policy must be one of {NORM_POLICIES}")
        self.params = params
        self.seed = seed
        self.clients_per_round = clients_per_round
        self.max_update_norm = max_update_norm
        self.update_norm_policy = update_norm_policy
        self.max_payload_bytes = max_payload_bytes  # None: PAYLOAD_FACTOR x the dense model
        self.aggregator = aggregator or Aggregator()
        # None: claims are taken as sent (a strategy built outside the round loop)
        self.example_bounds: ExampleBounds | None = None
        self.layout: Layout | None = None
        self.global_vector = torch.empty(0)
        self.stats = RoundStats()
        self.reachable: Callable[[int, list[int]], list[int]] = lambda rnd, nodes: nodes

    def bound_examples(self, bounds: ExampleBounds) -> None:
        """Bound each node's claimed `num-examples` by what the server knows (the round loop
        calls this once the node -> partition map is known; a method, so that it reaches
        the strategy inside a wrapper such as central DP)."""
        self.example_bounds = bounds

    # ----- selection and instructions -------------------------------------------------
    def select(self, server_round: int, candidates: Sequence[int]) -> list[int]:
        """Seeded uniform sample of `clients_per_round` nodes, kept in candidate order.

        The loop passes candidates in partition order, so the same partitions are drawn on
        every engine, whatever node ids the engine assigns.
        """
        k = min(self.clients_per_round, len(candidates))
        rng = np.random.default_rng([self.seed, server_round, 0x5E1])
        picked = rng.choice(len(candidates), size=k, replace=False)
        return [candidates[i] for i in sorted(picked)]

    def on_round_start(self, server_round: int) -> None:
        """Called once per round, after the global model is known, before any message."""

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        """Algorithm keys added to one node's ConfigRecord."""
        return {}

    def train_payload(self, server_round: int, node_id: int) -> dict[str, Any]:
        """Arrays (and codec record) sent to one node; dense global model by default."""
        return self._dense_payload

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per selected node, each with its own config and payload."""
        if self.layout is None:
            self.layout = Layout.of(arrays.to_torch_state_dict())
        self.global_vector = self.layout.flatten(arrays.to_torch_state_dict())
        self._dense_payload = encode_dense(self.global_vector, self.layout)
        self.on_round_start(server_round)
        nodes = sorted(grid.get_node_ids())
        chosen = self.select(server_round, self.reachable(server_round, nodes))
        self.stats = RoundStats(sent=list(chosen))
        messages = []
        for node_id in chosen:
            node_config = ConfigRecord(
                {**config, "server-round": server_round, **self.train_config(server_round, node_id)}
            )
            content = RecordDict(
                {**self.train_payload(server_round, node_id), "config": node_config}
            )
            messages.append(
                Message(content, node_id, MessageType.TRAIN, group_id=str(server_round))
            )
        return messages

    # ----- replies ----------------------------------------------------------------------
    def decode_reply(self, reply: Message) -> torch.Tensor:
        """The full model vector a reply stands for."""
        assert self.layout is not None
        return decode(reply.content, self.layout, base=self.global_vector)

    def payload_limit(self) -> float:
        """Largest reply, in bytes, that is decoded at all."""
        if self.max_payload_bytes is not None:
            return self.max_payload_bytes
        assert self.layout is not None
        sizes, dtypes = self.layout.sizes, self.layout.dtypes
        dense = sum(n * wire_dtype(d).itemsize for n, d in zip(sizes, dtypes, strict=True))
        return PAYLOAD_FACTOR * dense + PAYLOAD_SLACK

    def check_reply(self, reply: Message) -> ClientUpdate:
        """Decode and validate one reply; raise ValueError with the reason to reject it."""
        content = reply.content
        size, limit = content_bytes(content), self.payload_limit()
        if size > limit:
            raise ValueError(f"reply of {size} B exceeds max_payload_bytes {limit:.0f}")
        if "codec" in content.config_records:  # (a plain Flower client sends none: dense)
            declared_traffic(content)  # its byte counts feed the round's traffic figures
        if "metrics" not in content.metric_records:
            raise ValueError("reply has no 'metrics' record")
        metrics = dict(content.metric_records["metrics"])
        num_examples = metrics.get(self.weighted_by_key)
        if not isinstance(num_examples, int) or num_examples <= 0:
            raise ValueError(
                f"'{self.weighted_by_key}' must be a positive int, got {num_examples!r}"
            )
        node = reply.metadata.src_node_id
        loss = metrics.get("train-loss", 0.0)
        if not isinstance(loss, int | float):
            raise ValueError(f"'train-loss' must be a number, got {loss!r}")
        samples = metrics.get("samples", 0)  # the virtual clock charges compute by it
        if not isinstance(samples, int) or samples < 0:
            raise ValueError(f"'samples' must be a non-negative int, got {samples!r}")
        vector = self.decode_reply(reply)
        if not bool(torch.isfinite(vector).all()):
            raise ValueError("update has NaN or Inf values")
        delta = vector - self.global_vector
        norm = float(torch.linalg.vector_norm(delta))
        if norm > self.max_update_norm:
            if self.update_norm_policy == "reject":
                raise ValueError(
                    f"update norm {norm:.3g} exceeds max_update_norm {self.max_update_norm}"
                )
            log.warning("node %d: update norm %.3g clipped to %g", node, norm, self.max_update_norm)
            self.stats.norm_clipped += 1
            vector = self.global_vector + delta * (self.max_update_norm / norm)
        bound = self.example_bounds.limit(node) if self.example_bounds else None
        if bound is not None and num_examples > bound:  # clipped, not rejected: see docs
            log.warning(
                "node %d claims %d examples, more than the %d it can hold: weighted as %d",
                node,
                num_examples,
                bound,
                bound,
            )
            self.stats.examples_clipped += 1
            num_examples = bound
        return ClientUpdate(node, vector, num_examples, metrics)

    def accept(self, replies: Iterable[Message]) -> list[ClientUpdate]:
        """Replies that decode and validate; the rest are logged and counted, never used."""
        updates, replied = [], set()
        for reply in replies:
            replied.add(reply.metadata.src_node_id)
            node = reply.metadata.src_node_id
            if reply.has_error():
                self.stats.failed += 1
                log.warning("node %d failed: %s", node, reply.error.reason)
                continue
            try:
                updates.append(self.check_reply(reply))
            except (ValueError, CodecError, TypeError, KeyError) as err:
                self.stats.rejected += 1
                self.stats.reasons.append(f"node {node}: {err}")
                log.warning("rejected reply of node %d: %s", node, err)
        self._normalise_unbounded(updates)
        self.stats.accepted = len(updates)
        self.stats.updates = updates
        self.stats.missing = [node for node in self.stats.sent if node not in replied]
        return updates

    def _normalise_unbounded(self, updates: list[ClientUpdate]) -> None:
        """With bounds in force, a node the server knows no bound for weighs at most the
        round's median claim."""
        if self.example_bounds is None:
            return
        loose = [u for u in updates if self.example_bounds.limit(u.node_id) is None]
        if not loose:
            return
        typical = median_claim([u.num_examples for u in updates])
        for update in loose:
            if update.num_examples > typical:
                log.warning(
                    "node %d has no known example bound; its claim of %d is cut to the "
                    "round's median %d",
                    update.node_id,
                    update.num_examples,
                    typical,
                )
                update.num_examples = typical
                self.stats.examples_clipped += 1

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        """New global vector: the configured rule (`fl.robust`), by default the
        example-weighted mean of the client vectors (counts already bounded)."""
        weights = torch.tensor([u.num_examples for u in updates], dtype=torch.float64)
        return self.aggregator(torch.stack([u.vector for u in updates]), weights)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Accept, aggregate, and report the mean train metrics of the accepted replies."""
        updates = self.accept(replies)
        if not updates:
            return None, None
        if len(updates) < self.aggregator.min_replies:
            log.warning(
                "round %d: %d accepted replies, %s with num_malicious=%d needs %d: "
                "the global model is kept",
                server_round,
                len(updates),
                self.aggregator.name,
                self.aggregator.num_malicious,
                self.aggregator.min_replies,
            )
            self.stats.skipped = True
            return None, None
        assert self.layout is not None
        self.global_vector = self.aggregate(server_round, updates)
        total = sum(u.num_examples for u in updates)
        mean_loss = sum(float(u.metrics.get("train-loss", 0.0)) * u.num_examples for u in updates)
        metrics = MetricRecord({"num-examples": total, "train-loss": mean_loss / total})
        return vector_to_arrays(self.global_vector, self.layout), metrics

    def client_seconds(self, profile: DeviceProfile, work: ClientWork) -> float:
        """Virtual seconds one client's round takes; override to credit overlap."""
        return sequential_seconds(profile, work)

    # ----- diagnostics and resume -------------------------------------------------------
    def diagnostics(self) -> dict[str, Any]:
        """Per-round values for metrics.jsonl (subclasses add their own)."""
        stats = self.stats
        return {
            "rejected": stats.rejected,
            "failed": stats.failed,
            "missing": len(stats.missing),
            "examples_clipped": stats.examples_clipped,
            "norm_clipped": stats.norm_clipped,
            "aggregation_skipped": int(stats.skipped),
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to continue after a restart."""
        return {name: getattr(self, name) for name in self.state_attributes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        for name in self.state_attributes:
            setattr(self, name, state[name])
