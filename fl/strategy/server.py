"""The server half of a strategy: Flower's FedAvg with per-node messages and checks.

What it adds to `flwr.serverapp.strategy.FedAvg`: seeded client selection among the
nodes the run says are reachable, one message per node (a strategy may give each
node its own config and payload), replies decoded through `fl.wire.codec` and validated
before they can touch the global model, and `state_dict()` for resume.

Two kinds of method, kept apart: `ALGORITHM_HOOKS`, what a new algorithm may override
(docs/STRATEGIES.md shows each with an example), and `KERNEL_METHODS`, the plumbing the
round loop and the privacy wrappers call. Kernel methods are `typing.final`, and a
subclass that defines one is refused when its class is created.

Nothing a client reports is trusted: its claimed example count is clipped to the bound
the server knows (`bound_examples`, set by the round loop from the partition sizes), an
update beyond `max_update_norm` is rejected or clipped (`update_norm_policy`), and the
aggregation rule is pluggable (`fl.mechanisms.robust.Aggregator`: mean, median, trimmed mean,
Krum, Multi-Krum, Bulyan), so one client cannot decide the global model.

Why one module: the hooks and the kernel methods act on one object's state (global
vector, layout, round stats, nonces); split apart, each would reach into the other's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, ClassVar, final

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fl.common.checkpointable import check_state_kind, check_state_values
from fl.common.text import shown
from fl.mechanisms.robust import NORM_POLICIES, Aggregator, ExampleBounds, median_claim
from fl.mechanisms.roundrobin import RoundRobin
from fl.strategy.names import strategy_of
from fl.strategy.surface import ALGORITHM_HOOKS, KERNEL_METHODS, refuse_kernel_overrides
from fl.strategy.updates import (
    ClientUpdate,
    ReplyInfo,
    RoundStats,
    UploadParts,
    finite_metric,
    reply_limit,
)
from fl.wire.codec import CodecError, content_bytes, declared_traffic, decode, encode_dense
from fl.wire.cohort_reply import cohort_node_ids, is_cohort_reply, parse_cohort
from fl.wire.contract import CONTRACT_MISMATCH, NONCE_KEY, check_reply_error, stamp
from fl.wire.records import (
    Layout,
    extended_record,
    new_record,
    record_of,
    torch_state,
    vector_to_arrays,
)
from fl.wire.streaming import streamed_weighted_mean
from fl.wire.sync import Synced, SyncServer

__all__ = [
    "ALGORITHM_HOOKS",
    "KERNEL_METHODS",
    "ClientUpdate",
    "ReplyInfo",
    "RoundStats",
    "ServerStrategy",
    "UploadParts",
    "reply_limit",
]

log = logging.getLogger(__name__)


class ServerStrategy(FedAvg):
    """Base of our server halves; plain FedAvg when nothing is overridden."""

    # Attributes a checkpoint saves and a resume restores; stateful strategies list theirs.
    state_attributes: ClassVar[tuple[str, ...]] = ()
    # State attributes where NaN means "not measured yet" (checked: never ±inf)
    nan_sentinels: ClassVar[tuple[str, ...]] = ()
    # Privacy wrappers check these (privacy.config refuses the combination before round 1):
    # central DP's noise must reach every client's copy of the model; DP-SGD's accountant
    # assumes the run's own step count every round.
    central_dp_safe: ClassVar[bool] = True
    dpsgd_safe: ClassVar[bool] = True
    # Whether replies may land rounds after they were asked for (semi_async, groups, and
    # sync with late=carry): a strategy whose reply format depends on the round's state
    # (APF's mask, PAS's periods) must aggregate only replies to the current round.
    stale_replies_ok: ClassVar[bool] = True
    # The fewest local steps an honest client of this strategy may take when asked for
    # more (None: every step asked; FedCA's clients may stop after one). The virtual clock
    # charges a reply at least that much work, whatever samples it reports.
    min_local_steps: ClassVar[int | None] = None
    # The loop kinds the algorithm's mechanism lives in (None: any). Its conf/strategy file
    # selects the first by default; an explicit other `loop=` is refused (fl.run.loops).
    loop_kinds: ClassVar[tuple[str, ...] | None] = None
    # Whether its controller reads the global model's accuracy every round (ASFL's reward,
    # through `on_round_end`): such a strategy refuses `evaluate_every` > 1 (check_strategy).
    reads_round_accuracy: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a subclass that redefines kernel plumbing, naming the hook to use."""
        super().__init_subclass__(**kwargs)
        refuse_kernel_overrides(cls)

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
        strategy_name: str | None = None,
    ) -> None:
        super().__init__(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
        if update_norm_policy not in NORM_POLICIES:
            raise ValueError(f"update_norm_policy must be one of {NORM_POLICIES}")
        self.params = params
        # the name every instruction carries (fl.wire.contract), so that a ClientApp running
        # another strategy's half refuses it; by default the strategy that registered params
        self.strategy_name = strategy_name or strategy_of(params)
        self.seed = seed
        self.clients_per_round = clients_per_round
        self.max_update_norm = max_update_norm
        self.update_norm_policy = update_norm_policy
        self.max_payload_bytes = max_payload_bytes  # None: PAYLOAD_FACTOR x the dense model
        # whether a cohort's one reply may come (the round loop says so, where its engine
        # trains cohorts in process): off, one node could answer for others
        self.cohort_replies = False
        self.aggregator = aggregator or Aggregator()
        # None: claims are taken as sent (a strategy built outside the round loop)
        self.example_bounds: ExampleBounds | None = None
        self.layout: Layout | None = None
        self.global_vector = torch.empty(0)
        self.stats = RoundStats()  # of the current round, over all its exchanges
        self._stats_round = 0  # the round `stats` belongs to
        # the nodes a round may select, in a fixed order (the loop's: partition order)
        self.reachable: Callable[[int, Grid], Sequence[int]] = lambda rnd, grid: sorted(
            grid.get_node_ids()
        )
        self.wanted: int | None = None  # nodes to select this round (loop's choice), else k
        self.reply_info: dict[int, ReplyInfo] = {}  # set by the loop before aggregation
        self.extra_config: Callable[[int], dict[str, Any]] = lambda node: {}  # loop's keys
        self.staleness_exponent = 0.5  # a reply s rounds stale moves the model (1 + s)^-a
        specs = self.sync_specs()
        self.sync = SyncServer(specs) if specs else None
        self._nonces: dict[int, int] = {}  # node -> the nonce of its unanswered instruction

    @final
    def attach(
        self,
        *,
        reachable: Callable[[int, Grid], Sequence[int]],
        extra_config: Callable[[int], dict[str, Any]],
        staleness_exponent: float,
    ) -> None:
        """The round loop's view (methods, so that they reach the strategy inside a
        wrapper): the nodes it may ask, the keys it adds to each node's instruction
        (device profile, deadline), and the staleness weight's exponent."""
        self.reachable = reachable
        self.extra_config = extra_config
        self.staleness_exponent = staleness_exponent

    @final
    def plan(self, wanted: int | None) -> None:
        """How many nodes the next `configure_train` selects (None: clients_per_round)."""
        self.wanted = wanted

    @final
    def expect(self, reply_info: dict[int, ReplyInfo]) -> None:
        """Arrival, staleness and base of the replies the next aggregation receives."""
        self.reply_info = reply_info

    @final
    def base_of(self, node: int) -> torch.Tensor:
        """The global vector the reply of `node` was computed from."""
        info = self.reply_info.get(node)
        return info.base if info is not None else self.global_vector

    @final
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
        k = min(self.clients_per_round if self.wanted is None else self.wanted, len(candidates))
        rng = np.random.default_rng([self.seed, server_round, 0x5E1])
        picked = rng.choice(len(candidates), size=k, replace=False)
        return [candidates[i] for i in sorted(picked)]

    def on_round_start(self, server_round: int) -> None:
        """Called once per round, after the global model is known, before any message."""

    def another_exchange(self, server_round: int, done: int) -> bool:
        """Whether round `server_round` runs one more exchange after its `done`-th.

        Each exchange is a configure_train / aggregate_train pass through the loop (bytes,
        time, faults and privacy counted as for any round); `stats` and the metrics row
        cover them all. One per round by default.
        """
        return False

    def on_round_end(
        self, server_round: int, accuracy: float, loss: float, virtual_time_s: float
    ) -> None:
        """Called after each central evaluation (every round unless `evaluate_every` > 1),
        with the new global model's accuracy and loss and the virtual time the round ended
        at (for controllers such as ASFL's, which set `reads_round_accuracy`)."""

    def sync_specs(self) -> tuple[Synced, ...]:
        """Tensors this strategy's clients keep copies of (`fl.wire.sync`); none by default."""
        return ()

    def synced(self) -> dict[str, torch.Tensor]:
        """This round's values of the tensors named by `sync_specs`."""
        return {}

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        """Algorithm keys added to one node's ConfigRecord."""
        return {}

    def train_payload(self, server_round: int, node_id: int) -> dict[str, Any]:
        """Arrays (and codec record) sent to one node: the changes since the version it
        holds when the strategy syncs state (`fl.wire.sync`), else the dense global model."""
        if self.sync is None:
            return self._dense_payload
        assert self.layout is not None
        records, _ = self.sync.records(node_id, self.layout)
        return records if "arrays" in records else {**self._dense_payload, **records}

    @final
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per selected node, each with its own config and payload,
        stamped with this strategy's name and contract version (`fl.wire.contract`)."""
        state = torch_state(arrays)
        if self.layout is None:
            self.layout = Layout.of(state)
        self.global_vector = self.layout.flatten(state)
        self._dense_payload = encode_dense(self.global_vector, self.layout)
        first = server_round != self._stats_round  # a round's later exchanges add to it
        if first:
            self.on_round_start(server_round)
            if self.sync is not None:
                self.sync.publish(server_round, self.synced())
        chosen = self.select(server_round, self.reachable(server_round, grid))
        if first:
            self.stats, self._stats_round = RoundStats(), server_round
        sent_before = len(self.stats.sent)
        self.stats.sent.extend(chosen)
        shared = new_record(  # every node's keys, checked once for the exchange
            ConfigRecord,
            {
                **config,
                **(stamp(self.strategy_name) if self.strategy_name else {}),
                "server-round": server_round,
            },
        )
        # each instruction's nonce: its reply must echo it (fl.wire.contract); drawn for
        # the exchange at once, one a node, in selection order
        draw = np.random.default_rng([self.seed, server_round, sent_before, 0x0CE])
        nonces = draw.integers(0, 2**32, size=len(chosen)).tolist()
        messages = []
        for node_id, nonce in zip(chosen, nonces, strict=True):
            self._nonces[node_id] = nonce
            node_config = extended_record(
                shared,
                {
                    NONCE_KEY: nonce,
                    **self.extra_config(node_id),
                    **self.train_config(server_round, node_id),
                },
            )
            content = new_record(
                RecordDict, {**self.train_payload(server_round, node_id), "config": node_config}
            )
            messages.append(
                Message(content, node_id, MessageType.TRAIN, group_id=str(server_round))
            )
        return messages

    # ----- replies ----------------------------------------------------------------------
    def decode_reply(self, reply: Message, base: torch.Tensor) -> torch.Tensor:
        """The full model vector a reply stands for (`base`: the model it was sent)."""
        assert self.layout is not None
        return decode(reply.content, self.layout, base=base)

    @final
    def payload_limit(self) -> float:
        """Largest reply, in bytes, that is decoded at all."""
        if self.max_payload_bytes is not None:
            return self.max_payload_bytes
        assert self.layout is not None
        return reply_limit(self.layout)

    @final
    def check_reply(self, reply: Message) -> ClientUpdate:
        """Decode and validate one reply, then the strategy's `check_update`; raise
        ValueError with the reason to reject it."""
        content = reply.content
        size, limit = content_bytes(content), self.payload_limit()
        if size > limit:
            raise ValueError(f"reply of {size} B exceeds max_payload_bytes {limit:.0f}")
        if record_of(content, "codec", ConfigRecord) is not None:  # (Flower's clients: none)
            declared_traffic(content, size)  # its byte counts feed the round's traffic
        record = record_of(content, "metrics", MetricRecord)
        if record is None:
            raise ValueError("reply has no 'metrics' record")
        metrics = dict(record)
        node = reply.metadata.src_node_id
        num_examples = self._checked_metrics(node, metrics)
        base = self.base_of(node)
        vector = self.decode_reply(reply, base)
        delta = vector - base
        norm = float(torch.linalg.vector_norm(delta))
        vector, delta = self._within_norm(node, base, vector, delta, norm)
        return self._update(node, vector, delta, num_examples, metrics)

    def _checked_metrics(self, node: int, metrics: dict[str, Any]) -> int:
        """A reply's metrics checked (its echoed nonce taken out of `metrics`): its
        example count; ValueError with the reason otherwise."""
        echoed = metrics.pop(NONCE_KEY, None)
        if echoed is not None and echoed != self._nonces.get(node):
            raise ValueError("reply answers another instruction (an earlier round's, or replayed)")
        # a controller reading metrics (ASFL's reward, LB-BSP's speeds) never sees a NaN
        unfit = next((k for k, v in metrics.items() if not finite_metric(v)), None)
        if unfit is not None:
            raise ValueError(f"metric {unfit!r} is not finite: {metrics[unfit]!r}")
        num_examples = metrics.get(self.weighted_by_key)
        if not isinstance(num_examples, int) or num_examples <= 0:
            raise ValueError(
                f"'{self.weighted_by_key}' must be a positive int, got {num_examples!r}"
            )
        loss = metrics.get("train-loss", 0.0)
        if not isinstance(loss, int | float):
            raise ValueError(f"'train-loss' must be a number, got {loss!r}")
        samples = metrics.get("samples", 0)  # the virtual clock charges compute by it
        if not isinstance(samples, int) or samples < 0:
            raise ValueError(f"'samples' must be a non-negative int, got {samples!r}")
        return num_examples

    def _within_norm(
        self, node: int, base: torch.Tensor, vector: torch.Tensor, delta: torch.Tensor, norm: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`vector` and its `delta` from `base` under `max_update_norm` (clipped where the
        policy says so); ValueError for a non-finite or (policy reject) too large update."""
        # base is finite, so a NaN or Inf in the update shows in the norm: one pass, not two
        if not math.isfinite(norm):
            if not bool(torch.isfinite(vector).all()):
                raise ValueError("update has NaN or Inf values")
            # finite values whose norm overflows float32: their mean would too
            raise ValueError("update norm overflows (values near the float32 limit)")
        if norm > self.max_update_norm:
            if self.update_norm_policy == "reject":
                raise ValueError(
                    f"update norm {norm:.3g} exceeds max_update_norm {self.max_update_norm}"
                )
            log.warning("node %d: update norm %.3g clipped to %g", node, norm, self.max_update_norm)
            self.stats.norm_clipped += 1
            delta = delta * (self.max_update_norm / norm)
            vector = base + delta
        return vector, delta

    def _update(
        self,
        node: int,
        vector: torch.Tensor,
        delta: torch.Tensor,
        num_examples: int,
        metrics: dict[str, Any],
    ) -> ClientUpdate:
        """The checked reply as an update: its example count bounded, a stale one rebased,
        then the strategy's `check_update`."""
        info = self.reply_info.get(node)
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
        if info is None:
            return self.check_update(ClientUpdate(node, vector, num_examples, metrics))
        if info.staleness:
            vector = self.rebase(delta, info.staleness)
        update = ClientUpdate(node, vector, num_examples, metrics, info.staleness, info.arrived_s)
        return self.check_update(update)

    def check_update(self, update: ClientUpdate) -> ClientUpdate:
        """The strategy's own checks of a reply that passed the kernel's (its own metrics:
        present, finite, bounded by what the server saw); raise ValueError to reject it."""
        return update

    def rebase(self, delta: torch.Tensor, staleness: int) -> torch.Tensor:
        """A stale reply as a model on today's global: its step scaled by (1 + s)^-a
        (FedAsync's polynomial staleness weight; `loop.staleness_exponent` sets a)."""
        return self.global_vector + delta * (1 + staleness) ** -self.staleness_exponent

    @final
    def accept(self, replies: Iterable[Message]) -> list[ClientUpdate]:
        """Replies that decode and validate; the rest are logged and counted, never used.

        The sync protocol learns which version each client now holds: an accepted reply
        confirms it, a failed or rejected one (and a node given up on) is resynced. When
        every reply says its ClientApp runs another strategy's half, nothing can ever train:
        `ContractMismatch` stops the run, whichever loop drives it (ours, or Flower's own
        `Strategy.start`, which would otherwise go on with empty rounds).
        """
        updates: list[ClientUpdate] = []
        delivered = 0
        mismatched: list[Message] = []
        for reply in replies:
            if not reply.has_error() and is_cohort_reply(reply.content):
                landed = self._accept_cohort(reply, updates)
                delivered += landed
                continue
            node = reply.metadata.src_node_id
            self.stats.delivered.append(node)
            delivered += 1
            if reply.has_error() and reply.error.code == CONTRACT_MISMATCH:
                mismatched.append(reply)
            if reply.has_error():
                self.stats.failed += 1
                log.warning("node %d failed: %s", node, shown(reply.error.reason))
                self._forget(node)
                continue
            try:
                updates.append(self.check_reply(reply))
            except (ValueError, CodecError, TypeError, KeyError) as err:
                self._reject(node, err)
                continue
            self._answered(node)
        if delivered and len(mismatched) == delivered:
            check_reply_error(mismatched[0])
        self._normalise_unbounded(updates)
        self.stats.accepted += len(updates)
        self.stats.updates.extend(updates)
        return updates

    def _answered(self, node: int) -> None:
        """An accepted reply: its nonce is spent, and the sync protocol learns the version
        the node now holds."""
        self._nonces.pop(node, None)
        if self.sync is not None:
            info = self.reply_info.get(node)
            sent = info.sent_round if info is not None else self.sync.current
            self.sync.confirm(node, sent)

    def _reject(self, node: int, err: Exception) -> None:
        self.stats.rejected += 1
        self.stats.reasons.append(f"node {node}: {shown(err)}")  # (a reply's keys,
        log.warning("rejected reply of node %d: %s", node, shown(err))  # codec names)
        self._forget(node)

    def _accept_cohort(self, reply: Message, updates: list[ClientUpdate]) -> int:
        """A cohort's one reply (`fl.wire.cohort_reply`), checked as a batch: its members
        that landed (all, outside the round loop) are validated with one kernel for the
        rows' deltas and one for their norms, each member's metrics as its own reply's;
        the members that pass are added to `updates` in the reply's order, each that fails
        is rejected alone with its reason. Returns how many members landed."""
        assert self.layout is not None
        content, asked = reply.content, set(self._nonces)
        try:
            if not self.cohort_replies:
                raise ValueError("this run takes no cohort replies (one node answering for others)")
            ids = cohort_node_ids(content, asked)
        except ValueError as err:  # no member can be named: one reject, nothing used
            self.stats.rejected += 1
            self.stats.reasons.append(f"cohort reply: {shown(err)}")
            log.warning("rejected cohort reply: %s", shown(err))
            return 0
        landed = [n for n in ids if not self.reply_info or n in self.reply_info]
        if not landed:  # (the loop hands a reply on only where a member of it landed)
            return 0
        self.stats.delivered.extend(landed)
        try:
            if type(self).decode_reply is not ServerStrategy.decode_reply:
                raise ValueError(f"{type(self).__name__} decodes replies itself: no cohort reply")
            batch = parse_cohort(content, self.layout.numel, asked)
            size, limit = batch.rows.shape[1] * 4, self.payload_limit()
            if size > limit:
                raise ValueError(f"reply of {size} B exceeds max_payload_bytes {limit:.0f}")
        except ValueError as err:
            for node in landed:
                self._reject(node, err)
            return len(landed)
        position = {node: k for k, node in enumerate(batch.node_ids)}
        rows = batch.rows[[position[n] for n in landed]] if landed != ids else batch.rows
        bases = [self.base_of(node) for node in landed]
        shared = all(b is bases[0] for b in bases)  # one kernel for the cohort
        deltas = rows - (bases[0] if shared else torch.stack(bases))
        norms = torch.linalg.vector_norm(deltas, dim=1).tolist()  # one kernel: a screen
        # rows near the bound (or not finite) get their own row's norm, as a lone reply
        # would: the batched sum may differ from it in the last bits
        screen = self.max_update_norm * (1 - 1e-4)
        row_views, delta_views = rows.unbind(0), deltas.unbind(0)
        for k, node in enumerate(landed):
            metrics = {key: column[position[node]] for key, column in batch.metrics.items()}
            try:
                num_examples = self._checked_metrics(node, metrics)
                vector, delta = row_views[k], delta_views[k]
                if not (math.isfinite(norms[k]) and norms[k] <= screen):
                    norm = float(torch.linalg.vector_norm(delta))
                    vector, delta = self._within_norm(node, bases[k], vector, delta, norm)
                update = self._update(node, vector, delta, num_examples, metrics)
            except (ValueError, TypeError, KeyError) as err:
                self._reject(node, err)
                continue
            updates.append(update)
            self._answered(node)
        return len(landed)

    @final
    def give_up(self, nodes: Iterable[int], delivered: Mapping[int, int] | None = None) -> None:
        """The loop stopped waiting for these nodes (no reply, dropped, too late). Their
        nonces are spent. The sync protocol keeps the version each last confirmed, which
        the node holds whether or not the message reached it (`fl.wire.sync`), or takes the
        version sent where the loop knows the message arrived (`delivered`: node -> round)."""
        for node in nodes:
            self.stats.missing.append(node)
            self._nonces.pop(node, None)
            if self.sync is not None and delivered and node in delivered:
                self.sync.confirm(node, delivered[node])

    def _forget(self, node: int) -> None:
        self._nonces.pop(node, None)
        if self.sync is not None:
            self.sync.forget(node)

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
        """New global vector: the configured rule (`fl.mechanisms.robust`), by default the
        example-weighted mean of the client vectors (counts already bounded), summed in
        float64 block by block without stacking the replies (`fl.wire.streaming`); the robust
        rules need the stack."""
        weights = torch.tensor([u.num_examples for u in updates], dtype=torch.float64)
        vectors = [u.vector for u in updates]
        if self.aggregator.name == "mean":
            return streamed_weighted_mean(vectors, weights)
        return self.aggregator(torch.stack(vectors), weights)

    @final
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
        aggregate = self.aggregate(server_round, updates)
        if not bool(torch.isfinite(aggregate).all()):  # never applied: the model stays usable
            log.warning(
                "round %d: the aggregate is not finite: the global model is kept", server_round
            )
            self.stats.skipped = True
            return None, None
        self.global_vector = aggregate
        total = sum(u.num_examples for u in updates)
        mean_loss = sum(float(u.metrics.get("train-loss", 0.0)) * u.num_examples for u in updates)
        metrics = MetricRecord({"num-examples": total, "train-loss": mean_loss / total})
        return vector_to_arrays(self.global_vector, self.layout), metrics

    def arrivals_to_close(self, server_round: int) -> int | None:
        """Arrivals that close this round under `semi_async` (an RL controller such as
        ASFL's picks it per round); None: the loop's `buffer_k`."""
        return None

    def reserve_arrivals(self, server_round: int) -> Collection[int]:
        """Nodes whose arrivals land but close a semi-async round only where the others
        cannot fill `arrivals_to_close` (SAFA's CFCFM: those picked last round). None."""
        return ()

    def resync(self, server_round: int, in_flight: Mapping[int, int]) -> Collection[int]:
        """Nodes in flight (node -> round sent) the loop cancels before this round's
        selection, so they may be sent the current model (SAFA's forced resync). None."""
        return ()

    def group_schedule(self) -> RoundRobin | None:
        """The order and start times of groups under `loop=groups` (R2SP's round-robin
        schedule, `fl.mechanisms.roundrobin`); None: every idle group starts at once."""
        return None

    def upload_parts(self, node_id: int, up_bytes: int) -> UploadParts:
        """How a reply leaves the client: all at the end of training by default; a
        strategy that sends parts early (PAS's period groups) says when each may go."""
        return ((1.0, up_bytes),)

    def reply_parts(self, reply: Message, up_bytes: int) -> UploadParts:
        """How this reply leaves its client, for the clock: `upload_parts` of its node by
        default; a strategy whose client decides when parts leave (FedCA's eager layers)
        reads the reply's own account here, bounded by what the reply holds."""
        return self.upload_parts(reply.metadata.src_node_id, up_bytes)

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
        state = {name: getattr(self, name) for name in self.state_attributes}
        if self.sync is not None:
            state["sync"] = self.sync.state_dict()
        state["nonces"] = dict(self._nonces)  # instructions still in flight (semi_async)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; each attribute must keep the kind it has
        (a checkpoint is untrusted: a dict stays a dict, a tensor a tensor, a number a
        number) and hold only finite numbers, checked before any is set, so a bad one
        changes nothing."""
        check_state_values("", state, nan_ok=self.nan_sentinels)
        for name in self.state_attributes:
            check_state_kind(name, getattr(self, name, None), state[name])
        for name in self.state_attributes:
            setattr(self, name, state[name])
        if self.sync is not None:
            self.sync.load_state_dict(state["sync"])
        nonces = state.get("nonces", {})  # (checkpoints from before nonces: none)
        if not isinstance(nonces, dict) or not all(
            isinstance(k, int) and isinstance(v, int) for k, v in nonces.items()
        ):
            raise ValueError("strategy state: nonces are not node -> int")
        self._nonces = dict(nonces)
