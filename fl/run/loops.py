"""Loop kinds: when a round closes and which replies it aggregates, on the virtual clock.

Every engine trains a dispatched node at once and returns its reply; the virtual clock
(`fl.world.clock`) decides when that reply *arrives*. The loop kind decides when a round
closes and which arrived replies the strategy aggregates:

- `sync`: a round waits for every reply it asked for, up to a deadline; with
  `first_k_fraction` it closes at the ceil(f·n)-th arrival. Replies that miss the close
  are dropped (`late=drop`, the server stops waiting) or carried (`late=carry`: they
  land in a later round, stale).
- `semi_async`: `clients_per_round` nodes stay in flight; a round closes at the
  `buffer_k`-th arrival from any round; nodes still training keep going and are not
  asked again until their reply lands, unless the strategy has them cancelled at a
  round's start (`cancel`: SAFA's forced resync). A strategy may name a reserve whose
  arrivals count toward the close only where the others cannot fill it (SAFA's CFCFM).
- `groups`: nodes form fixed groups (partition p in group p mod G) with their own
  timelines; every idle group is dispatched, and a round closes when a group has
  fully arrived (R2SP-style overlapping timelines on the shared server link). A
  strategy may hand the loop a round-robin schedule (`fl.mechanisms.roundrobin`): groups then
  start in turn, each held until its start time, instead of as soon as they are idle.

Where replies arrive is the loop's `arrival` order. `virtual` (the local and flower-sim
engines): the clock decides, so every engine aggregates the same replies in the same
rounds, deterministically. `real` (the default of `engine=deployment`): replies land in
the order they reach the server, deadlines are wall seconds, and time is the wall clock;
in-flight instructions are not part of a checkpoint, so a resumed run re-asks those nodes.

Why one module: the round driver's dispatch, close, cancellation and checkpoint state all
read and write one table of flights; split apart, each piece would reach into the others'
fields. The work bounds the clock charges (`WorkBounds`) are the driver's input.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from flwr.app import Error, Message, MessageType, Metadata, MetricRecord, RecordDict
from omegaconf import DictConfig, OmegaConf

from fl.common.config import check_choice, check_int, check_number, is_finite, require
from fl.common.errors import RunError
from fl.mechanisms.roundrobin import RoundRobin
from fl.run.arrivals import RealArrivals
from fl.strategy.server import ReplyInfo, UploadParts
from fl.wire.codec import Traffic, payload_traffic
from fl.wire.cohort_reply import COHORT_METRICS, cohort_node_ids, is_cohort_reply, member_traffic
from fl.wire.records import record_of
from fl.world.clock import Job, VirtualClock
from fl.world.population import NodeIds

log = logging.getLogger(__name__)

__all__ = [
    "ARRIVAL_ORDERS",
    "LATE_POLICIES",
    "LOOP_KINDS",
    "Landed",
    "LoopSettings",
    "RoundDriver",
    "WorkBounds",
    "check_loop",
    "loop_settings",
]

LOOP_KINDS = ("sync", "semi_async", "groups")
LATE_POLICIES = ("drop", "carry")
ARRIVAL_ORDERS = ("virtual", "real")


@dataclass(frozen=True)
class LoopSettings:
    """The `loop` config group (conf/loop/*.yaml)."""

    kind: str = "sync"
    deadline_s: float | None = None  # virtual seconds a round waits after it starts
    first_k_fraction: float | None = None  # sync: close at the ceil(f·n)-th arrival
    late: str = "drop"  # sync: what happens to replies that miss the close
    buffer_k: int | None = None  # semi_async: arrivals that close a round (None: half)
    groups: int = 2  # groups: number of groups
    staleness_exponent: float = 0.5  # a reply s rounds stale weighs (1 + s)^-a
    arrival: str = "virtual"  # virtual (the clock's order) | real (as replies reach us)

    @property
    def stale(self) -> bool:
        """Whether replies may land in a later round than they were asked in."""
        return self.kind != "sync" or self.late == "carry"


def loop_settings(cfg: Any) -> LoopSettings:
    """The run's `loop` group as settings (checked by `check_loop` before any round).

    `loop.arrival: null` is real order on `engine=deployment` and virtual elsewhere.
    """
    values = {k: v for k, v in dict(cfg.loop).items() if k != "name"}
    if values.get("arrival") is None:
        values["arrival"] = "real" if cfg.engine.name == "deployment" else "virtual"
    return LoopSettings(**values)


@dataclass
class Flight:
    """One instruction the server is still waiting on, with the reply it will bring."""

    node: int
    sent_round: int
    reply: Message | None  # None until a real arrival brings it
    up: Traffic
    arrived_s: float | None = None  # set once the clock delivered it
    sent_s: float = 0.0  # when it was sent (real) or its download began (virtual)
    compute_s: float | None = None  # its compute span on the virtual clock, once arrived


@dataclass
class Landed:
    """What one round's close hands to the strategy."""

    replies: list[Message] = field(default_factory=list)  # in partition order
    info: dict[int, ReplyInfo] = field(default_factory=dict)
    up: list[Traffic] = field(default_factory=list)  # bytes of the landed replies
    given_up: list[int] = field(default_factory=list)  # nodes the server stopped waiting on
    # of those, the ones whose message had reached them (node -> round sent): their client
    # holds what it was sent (known on the virtual clock; never assumed for real arrivals)
    delivered: dict[int, int] = field(default_factory=dict)


class RoundDriver:
    """In-flight instructions, their arrivals, and each loop kind's close rule."""

    def __init__(
        self,
        settings: LoopSettings,
        clock: VirtualClock,
        partitions: Mapping[int, int],
        deadline_s: float,
        real: RealArrivals | None = None,
        schedule: RoundRobin | None = None,
        cohort_replies: bool = False,
    ) -> None:
        """`real`: where real arrivals come from (`arrival=real`); `deadline_s` is then in
        wall seconds, and also bounds how long an unanswered instruction is waited for.
        `schedule`: the strategy's round-robin order and start times of groups (R2SP).
        `cohort_replies`: whether a cohort's one reply may come (else it is dropped)."""
        self.settings = settings
        self.clock = clock
        self.partitions = partitions
        self.deadline_s = deadline_s
        self.real = real
        self.flights: dict[int, Flight] = {}
        self.bases: dict[int, torch.Tensor] = {}  # sent round -> global vector it carried
        self.schedule = schedule
        self.cohort_replies = cohort_replies
        self.held: dict[int, tuple[Job, float]] = {}  # node -> its job, its start time
        if schedule is not None:
            if settings.kind != "groups" or real is not None:
                raise RunError(
                    "the strategy starts groups in turn on the virtual clock: use "
                    f"loop=groups with virtual arrivals, not loop.kind={settings.kind}"
                    + (" with real arrivals" if real is not None else "")
                )
            schedule.bind(settings.groups)

    @property
    def timed(self) -> bool:
        """Whether rounds close at a deadline (sync always; others when one is set)."""
        return self.settings.kind == "sync" or self.settings.deadline_s is not None

    @property
    def client_deadline_s(self) -> float:
        """The deadline a client is told: virtual seconds after sending (inf: none)."""
        return self.deadline_s if self.timed else math.inf

    # ----- selection --------------------------------------------------------------------
    def wanted(self, clients_per_round: int, candidates: int) -> int | None:
        """Nodes the strategy selects this round (None: its own clients_per_round)."""
        if self.settings.kind == "semi_async":
            return max(clients_per_round - len(self.flights), 0)
        if self.settings.kind == "groups":
            return candidates  # every idle group, whole
        return None

    def idle(self, nodes: NodeIds) -> NodeIds:
        """The nodes that may be asked now: none in flight, and for `groups` only whole
        groups none of whose members is in flight. Vectorised: `nodes` may be millions."""
        if self.settings.kind != "groups":
            return nodes.without(self.flights)
        if nodes.partitions is None:  # (the loop's candidates, from the population, carry them)
            raise ValueError("loop=groups needs candidates that carry their partitions")
        groups = nodes.partitions % self.settings.groups
        busy = {self._group(n) for n in self.flights}
        free = ~np.isin(groups, list(busy))
        if self.schedule is not None:
            due = self.schedule.due(set(np.unique(groups[free]).tolist()), busy)
            free &= np.isin(groups, list(due))
        return nodes.where(free)

    def _group(self, node: int) -> int:
        return self.partitions[node] % self.settings.groups

    def in_flight(self) -> dict[int, int]:
        """Nodes whose reply has not arrived, each with the round it was sent in."""
        return {n: f.sent_round for n, f in self.flights.items() if f.arrived_s is None}

    def cancel(self, nodes: Iterable[int]) -> list[int]:
        """Stop the work of those `nodes` still in flight (others are ignored): they are
        idle again, so they may be asked anew; returned in partition order."""
        flying = self.in_flight()
        gone = sorted({n for n in nodes if n in flying}, key=self.partitions.__getitem__)
        for node in gone:
            self._cancel(node)
            del self.flights[node]
        return gone

    # ----- dispatch ---------------------------------------------------------------------
    def dispatch(
        self,
        server_round: int,
        base: torch.Tensor,
        replies: list[Message],
        down: Mapping[int, Traffic],
        asked: Mapping[int, WorkBounds],
        upload_parts: Callable[[Message, int], UploadParts],
    ) -> list[int]:
        """Put this round's replies on the clock; return the nodes that sent none."""
        if down:
            self.bases[server_round] = base
        replied: set[int] = set()
        jobs: list[Job] = []
        for reply in replies:
            if reply.has_content() and is_cohort_reply(reply.content):
                jobs += self._dispatch_cohort(
                    server_round, reply, down, asked, replied, upload_parts
                )
                continue
            node = reply.metadata.src_node_id
            if node not in down or node in replied:
                continue  # not asked this round, or a duplicate: never counted
            replied.add(node)
            up = payload_traffic(reply.content) if reply.has_content() else Traffic(0)
            samples, parts = asked[node].high, upload_parts(reply, up.total)
            if reply.has_error():  # crashed: the server learns it once the work is due
                parts = ()
            elif reply.has_content():
                samples = _reported_samples(reply, asked[node])
            self.flights[node] = Flight(node, server_round, reply, up, sent_s=self.clock.now)
            jobs.append(Job(node, self.partitions[node], down[node].total, samples, parts))
        self._start(jobs)
        return sorted((n for n in down if n not in replied), key=self.partitions.__getitem__)

    def _dispatch_cohort(
        self,
        server_round: int,
        reply: Message,
        down: Mapping[int, Traffic],
        asked: Mapping[int, WorkBounds],
        replied: set[int],
        upload_parts: Callable[[Message, int], UploadParts],
    ) -> list[Job]:
        """A cohort's one reply (`fl.wire.cohort_reply`) on the clock member by member, as
        their own replies would be: each its row's bytes and reported samples. Its ids are
        untrusted: a reply naming a node not waited on, or one twice, is dropped whole
        (its members count as sending none) with the reason logged."""
        waiting = [n for n in down if n not in replied]
        try:
            if not self.cohort_replies:
                raise ValueError("this run takes no cohort replies (one node answering for others)")
            members = cohort_node_ids(reply.content, set(waiting))
        except ValueError as err:
            log.warning("round %d: cohort reply dropped: %s", server_round, err)
            return []
        up = member_traffic(reply.content, len(members))
        metrics = record_of(reply.content, COHORT_METRICS, MetricRecord)
        found = metrics.get("samples") if metrics is not None else None
        column: list[Any] = [None] * len(members)  # no counts: each charged the most asked
        if isinstance(found, list) and len(found) == len(members):
            column = list(found)
        parts = upload_parts(reply, up.total)  # the default timing: no member's own
        jobs = []
        for node, reported in zip(members, column, strict=True):
            replied.add(node)
            samples = _clamped_samples(reported, asked[node])
            self.flights[node] = Flight(node, server_round, reply, up, sent_s=self.clock.now)
            jobs.append(Job(node, self.partitions[node], down[node].total, samples, parts))
        return jobs

    def _start(self, jobs: list[Job]) -> None:
        """Put jobs on the clock now, or under a schedule each group at its start time."""
        if self.schedule is None:
            self.clock.submit_many(jobs)
            return
        by_group: dict[int, list[Job]] = {}
        for job in jobs:
            by_group.setdefault(self._group(job.key), []).append(job)
        turn, groups = self.schedule.turn, self.settings.groups
        for group in sorted(by_group, key=lambda g: (g - turn) % groups):
            members = by_group[group]
            start = self.schedule.release(group, self.clock.now, self._solo_span_s(members))
            for job in members:
                self.flights[job.key].sent_s = start
                self.held[job.key] = (job, start)
        self._release_held()

    def _release_held(self) -> None:
        """Submit the held jobs whose start time has come."""
        due = [
            node for node, (_, start_s) in sorted(self.held.items()) if start_s <= self.clock.now
        ]
        self.clock.submit_many([self.held.pop(node)[0] for node in due])

    def _next_release_s(self) -> float:
        return min((start_s for _, start_s in self.held.values()), default=math.inf)

    def _solo_span_s(self, jobs: list[Job]) -> float:
        """A group's span with the server link to itself (its members' transfers share
        it, nobody else's): the first estimate of R2SP's iteration span T."""
        share, now = self.clock.server_bytes_per_s / len(jobs), self.clock.now
        spans = []
        for job in jobs:
            profile, up = self.clock.profiles[job.partition], sum(b for _, b in job.uploads)
            spans.append(
                job.down_bytes / min(profile.down_bytes_per_s, share)
                + job.samples / self.clock.speed(job.partition, now)
                + up / min(profile.up_bytes_per_s, share)
            )
        return max(spans)

    def push(
        self, server_round: int, base: torch.Tensor, messages: list[Message], down: Mapping
    ) -> None:
        """Send this round's instructions for real arrivals (`arrival=real`)."""
        assert self.real is not None, "push is for real arrivals; dispatch replies otherwise"
        if down:
            self.bases[server_round] = base
        sent_s = self.real.now
        for message in messages:
            node = message.metadata.dst_node_id
            self.flights[node] = Flight(node, server_round, None, Traffic(0), sent_s=sent_s)
        self.real.push(messages)

    def sync_clock(self) -> None:
        """With real arrivals, bring the clock to the wall time since training began."""
        if self.real is not None:
            self.clock.wait(max(self.real.now - self.clock.now, 0.0))

    # ----- close ------------------------------------------------------------------------
    def close(
        self,
        server_round: int,
        started_s: float,
        dispatched: int,
        missing: list[int],
        buffer_k: int | None = None,
        reserve: Collection[int] = (),
    ) -> Landed:
        """Advance the clock to this round's close; return what lands in it.

        `missing`: nodes asked this round that sent no reply. A sync round still waits
        for them until its deadline (the server cannot know they will not come).
        `buffer_k`: the strategy's own semi-async close for this round, if it sets one.
        `reserve`: nodes whose arrivals land but count toward the close only as far as the
        other nodes, landed or in flight, fall short of it (`_counted`).
        """
        kind = self.settings.kind
        timed = self.timed or self.real is not None  # real waits are always bounded
        until = started_s + self.deadline_s if timed else math.inf
        landed: list[Flight] = []
        given_up = list(missing)
        target = self._target(dispatched, len(missing), buffer_k)
        reserve = frozenset(reserve)
        arrived = [f for f in self.flights.values() if f.arrived_s is not None]  # groups
        while True:
            if kind == "groups" and (group := self._complete_group(arrived)) is not None:
                landed = [f for f in arrived if self._group(f.node) == group]
                if self.schedule is not None:
                    self.schedule.landed(group, max(f.arrived_s or 0.0 for f in landed))
                break
            if kind != "groups" and self._counted(landed, reserve, target) >= target:
                break
            arrival = self._next_arrival(min(until, self._next_release_s()))
            if arrival is None:
                if self.held and self.clock.now >= self._next_release_s():
                    self._release_held()  # a scheduled group starts
                    continue
                break
            node, arrived_s, dropped, compute_s = arrival
            if dropped:  # the device went offline: its reply never comes
                del self.flights[node]
                given_up.append(node)
                continue
            flight = self.flights[node]
            flight.arrived_s, flight.compute_s = arrived_s, compute_s
            (arrived if kind == "groups" else landed).append(flight)
        if kind == "groups" and not landed and arrived and math.isfinite(until):
            landed = arrived  # deadline: whatever has arrived lands
        for flight in landed:
            del self.flights[flight.node]
        drop_all = kind == "sync" and self.settings.late == "drop"
        delivered: dict[int, int] = {}
        for node in sorted(self.flights):  # the rest of this round, or waited on too long
            if drop_all or self._expired(self.flights[node]):
                if self._cancel(node):
                    delivered[node] = self.flights[node].sent_round
                given_up.append(node)
                del self.flights[node]
        self.sync_clock()
        return self._landed(server_round, landed, given_up, delivered)

    def _next_arrival(self, until: float) -> tuple[int, float, bool, float | None] | None:
        """(node, arrival time, dropped, compute span) of the next reply to land by `until`,
        or None; the span is the virtual clock's (None on real arrivals)."""
        if self.real is None:
            a = self.clock.next_arrival(until)
            if a is None:
                return None
            return a.key, a.arrived_s, a.dropped, max(a.computed_s - a.downloaded_s, 0.0)
        got = self.real.next_arrival(until)
        if got is None:
            return None
        node, reply, landed_s = got
        flight = self.flights[node]
        flight.reply = reply
        flight.up = payload_traffic(reply.content) if reply.has_content() else Traffic(0)
        return node, landed_s, False, None

    def _expired(self, flight: Flight) -> bool:
        """A real instruction unanswered for longer than the deadline: its node is gone."""
        return (
            self.real is not None
            and flight.arrived_s is None
            and self.real.now >= flight.sent_s + self.deadline_s
        )

    def _cancel(self, node: int) -> bool:
        """Stop `node`'s work; whether its message had reached it (the virtual clock knows
        when a download ended; a real node's receipt is not observed, so False)."""
        if self.held.pop(node, None) is not None:
            return False  # never started
        if self.real is not None:
            self.real.cancel(node)
            return False
        return self.clock.cancel(node)

    def _target(self, dispatched: int, missing: int, buffer_k: int | None) -> int:
        """Arrivals that close a round (sync, semi_async)."""
        settings = self.settings
        if settings.kind == "semi_async":
            k = buffer_k or settings.buffer_k or max(1, math.ceil(len(self.flights) / 2))
            return min(k, len(self.flights))
        if settings.first_k_fraction is not None:
            return math.ceil(settings.first_k_fraction * dispatched)
        return len(self.flights) + missing

    def _counted(self, landed: list[Flight], reserve: Collection[int], target: int) -> int:
        """Arrivals that count toward the close: every one from outside `reserve`, and of
        the reserve's, in arrival order, as many as the others (landed, or still in flight
        and so still able to land) fall short of `target` (SAFA's compensatory top-up)."""
        if not reserve:
            return len(landed)
        preferred = sum(f.node not in reserve for f in landed)
        flying = sum(f.arrived_s is None and n not in reserve for n, f in self.flights.items())
        shortfall = max(target - preferred - flying, 0)
        return preferred + min(len(landed) - preferred, shortfall)

    def _complete_group(self, arrived: list[Flight]) -> int | None:
        """The group whose members have all arrived first (ties: lowest group)."""
        waiting = {self._group(f.node) for f in self.flights.values() if f.arrived_s is None}
        done = {self._group(f.node) for f in arrived} - waiting
        if not done:
            return None
        last = {
            g: max(f.arrived_s or 0.0 for f in arrived if self._group(f.node) == g) for g in done
        }
        return min(done, key=lambda g: (last[g], g))

    def _landed(
        self,
        server_round: int,
        flights: list[Flight],
        given_up: list[int],
        delivered: dict[int, int],
    ) -> Landed:
        flights.sort(key=lambda f: self.partitions[f.node])  # engine-independent order
        out = Landed(
            given_up=sorted(given_up, key=self.partitions.__getitem__), delivered=delivered
        )
        cohorts: set[int] = set()  # a cohort reply lands once, where its first member lands
        for flight in flights:
            assert flight.reply is not None, "only arrived replies land"
            if id(flight.reply) not in cohorts:
                out.replies.append(flight.reply)
            if flight.reply.has_content() and is_cohort_reply(flight.reply.content):
                cohorts.add(id(flight.reply))
            out.up.append(flight.up)
            out.info[flight.node] = ReplyInfo(
                sent_round=flight.sent_round,
                staleness=server_round - flight.sent_round,
                arrived_s=float(flight.arrived_s or 0.0),
                base=self.bases[flight.sent_round],
                sent_s=flight.sent_s,
                compute_s=flight.compute_s,
            )
        live = {f.sent_round for f in self.flights.values()}
        self.bases = {r: b for r, b in self.bases.items() if r in live or r == server_round}
        return out

    # ----- resume -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """In-flight replies (content as RecordDicts), their bases, the clock, the jobs
        held for a scheduled start and the schedule.

        Real instructions still unanswered are left out: a resumed run cannot receive
        their replies, so it treats those nodes as idle.
        """
        return {
            "clock": self.clock.state_dict(),
            "bases": dict(self.bases),
            "flights": {
                str(node): {
                    "sent_round": f.sent_round,
                    "content": f.reply.content if f.reply.has_content() else RecordDict(),
                    "error": f.reply.error.reason if f.reply.has_error() else None,
                    "up": [f.up.payload, f.up.control],
                    "arrived_s": f.arrived_s,
                    "sent_s": f.sent_s,
                    "compute_s": f.compute_s,
                }
                for node, f in self.flights.items()
                if f.reply is not None
            },
            "held": {
                str(node): {
                    "partition": job.partition,
                    "down_bytes": job.down_bytes,
                    "samples": job.samples,
                    "uploads": [[float(f), int(b)] for f, b in job.uploads],
                    "start_s": start_s,
                }
                for node, (job, start_s) in self.held.items()
            },
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.clock.load_state_dict(state["clock"])
        self.bases = dict(state["bases"])
        self.flights = {}
        for key, saved in state["flights"].items():
            node = int(key)
            reply = _reply(node, saved["sent_round"], saved["content"], saved["error"])
            up = Traffic(int(saved["up"][0]), int(saved["up"][1]))
            self.flights[node] = Flight(
                node,
                int(saved["sent_round"]),
                reply,
                up,
                saved["arrived_s"],
                float(saved.get("sent_s", 0.0)),
                _span(saved.get("compute_s")),
            )
        self.held = {
            int(key): (
                Job(
                    int(key),
                    int(s["partition"]),
                    int(s["down_bytes"]),
                    int(s["samples"]),
                    tuple((float(f), int(b)) for f, b in s["uploads"]),
                ),
                float(s["start_s"]),
            )
            for key, s in state.get("held", {}).items()
        }
        if self.schedule is not None and state.get("schedule") is not None:
            self.schedule.load_state_dict(state["schedule"])


def _span(value: Any) -> float | None:
    """A checkpointed compute span: a finite, non-negative number, or None."""
    return float(value) if is_finite(value) and value >= 0 else None


class WorkBounds(NamedTuple):
    """The samples a node may honestly process in a round: `low` (a short last batch, a
    strategy's early stop) to `high` (what it was asked for)."""

    low: int
    high: int


def _reported_samples(reply: Message, bounds: WorkBounds) -> int:
    """Samples the clock charges: what the reply reports, within what an honest client may
    process (no free time for claiming less, no delay for claiming more)."""
    metrics = record_of(reply.content, "metrics", MetricRecord)
    return _clamped_samples(metrics.get("samples") if metrics is not None else None, bounds)


def _clamped_samples(reported: Any, bounds: WorkBounds) -> int:
    """Reported samples within `bounds`; the most asked for where the report is no count."""
    if isinstance(reported, int) and not isinstance(reported, bool) and reported >= 0:
        return min(max(reported, bounds.low), bounds.high)
    return bounds.high


def _reply(node: int, sent_round: int, content: RecordDict, error: str | None) -> Message:
    """A restored reply from `node` (metadata rebuilt: only its source is read)."""
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=node,
        dst_node_id=0,
        reply_to_message_id="",
        group_id=str(sent_round),
        created_at=0.0,
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )
    if error is not None:
        return Message(Error(code=0, reason=error), metadata=metadata)  # type: ignore[call-overload]
    return Message(content, metadata=metadata)  # type: ignore[call-overload]


def check_loop(cfg: DictConfig) -> None:
    """The loop kind and its options, and whether the strategy takes replies that land late."""
    from fl.strategy.registry import get_strategy

    check_choice(cfg, "loop.kind", LOOP_KINDS)
    check_choice(cfg, "loop.late", LATE_POLICIES)
    if OmegaConf.select(cfg, "loop.arrival") is not None:
        check_choice(cfg, "loop.arrival", ARRIVAL_ORDERS)
    check_number(cfg, "loop.deadline_s", 0, strict=True, null=True)
    check_number(cfg, "loop.first_k_fraction", 0, 1, strict=True, null=True)
    check_number(cfg, "loop.staleness_exponent", 0)
    check_int(cfg, "loop.groups", 1, cfg.num_clients)
    if cfg.loop.buffer_k is not None:
        check_int(cfg, "loop.buffer_k", 1, cfg.clients_per_round)
    kind, late = cfg.loop.kind, cfg.loop.late
    stale = kind != "sync" or late == "carry"
    server = get_strategy(str(cfg.strategy.name)).server
    kinds = getattr(server, "loop_kinds", None)
    require(
        kinds is None or kind in kinds,
        "loop",
        kind,
        f"strategy={cfg.strategy.name} runs on loop={' or loop='.join(kinds or ())}, where its "
        f"mechanism lives (on loop={kind} it would be another algorithm under its name); drop "
        "loop= to get it",
    )
    # Name what the user wrote: loop=semi_async (whose replies land late by design), or
    # loop.late=carry on the sync loop; not the loop's internal late=carry default.
    key, value = ("loop", kind) if kind != "sync" else ("loop.late", late)
    late_how = f"loop={kind} lands replies late" if kind != "sync" else "carried replies land late"
    fix = "use loop=sync" if kind != "sync" else "use loop.late=drop (the default)"
    require(
        not stale or getattr(server, "stale_replies_ok", True),
        key,
        value,
        f"strategy={cfg.strategy.name} needs every reply in the round it was asked for, "
        f"and {late_how}: it aggregates only replies to the current round's state; {fix}",
    )
    central = OmegaConf.select(cfg, "privacy.server_dp.mode", default="none") != "none"
    require(
        not stale or not central,
        key,
        value,
        f"central DP clips each update against the current model, and {late_how}; {fix}",
    )
