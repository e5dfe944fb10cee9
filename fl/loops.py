"""Loop kinds: when a round closes and which replies it aggregates, on the virtual clock.

Every engine trains a dispatched node at once and returns its reply; the virtual clock
(`fl.clock`) decides when that reply *arrives*. The loop kind decides when a round
closes and which arrived replies the strategy aggregates:

- `sync`: a round waits for every reply it asked for, up to a deadline; with
  `first_k_fraction` it closes at the ceil(f·n)-th arrival. Replies that miss the close
  are dropped (`late=drop`, the server stops waiting) or carried (`late=carry`: they
  land in a later round, stale).
- `semi_async`: `clients_per_round` nodes stay in flight; a round closes at the
  `buffer_k`-th arrival from any round; nodes still training keep going and are not
  asked again until their reply lands.
- `groups`: nodes form fixed groups (partition p in group p mod G) with their own
  timelines; every idle group is dispatched, and a round closes when a group has
  fully arrived (R2SP-style overlapping timelines on the shared server link).

Because arrival order is virtual, every engine aggregates the same replies in the same
rounds: the local engine stays deterministic and all engines bit-identical. Real
arrival order in deployments is not used (documented in docs/STRATEGIES.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Error, Message, MessageType, Metadata, RecordDict

from fl.clock import Job, VirtualClock
from fl.codec import Traffic, payload_traffic
from fl.strategy import ReplyInfo, UploadParts

__all__ = ["LATE_POLICIES", "LOOP_KINDS", "Landed", "LoopSettings", "RoundDriver", "loop_settings"]

LOOP_KINDS = ("sync", "semi_async", "groups")
LATE_POLICIES = ("drop", "carry")


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

    @property
    def stale(self) -> bool:
        """Whether replies may land in a later round than they were asked in."""
        return self.kind != "sync" or self.late == "carry"


def loop_settings(cfg: Any) -> LoopSettings:
    """The run's `loop` group as settings (validated by fl.config before any round)."""
    values = {k: v for k, v in dict(cfg.loop).items() if k != "name"}
    return LoopSettings(**values)


@dataclass
class Flight:
    """One instruction the server is still waiting on, with the reply it will bring."""

    node: int
    sent_round: int
    reply: Message
    up: Traffic
    arrived_s: float | None = None  # set once the clock delivered it


@dataclass
class Landed:
    """What one round's close hands to the strategy."""

    replies: list[Message] = field(default_factory=list)  # in partition order
    info: dict[int, ReplyInfo] = field(default_factory=dict)
    up: list[Traffic] = field(default_factory=list)  # bytes of the landed replies
    given_up: list[int] = field(default_factory=list)  # nodes the server stopped waiting on


class RoundDriver:
    """In-flight instructions, their arrivals, and each loop kind's close rule."""

    def __init__(
        self,
        settings: LoopSettings,
        clock: VirtualClock,
        partitions: Mapping[int, int],
        deadline_s: float,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.partitions = dict(partitions)
        self.deadline_s = deadline_s
        self.flights: dict[int, Flight] = {}
        self.bases: dict[int, torch.Tensor] = {}  # sent round -> global vector it carried

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

    def idle(self, nodes: list[int]) -> list[int]:
        """The nodes that may be asked now: none in flight, and for `groups` only whole
        groups none of whose members is in flight."""
        if self.settings.kind != "groups":
            return [n for n in nodes if n not in self.flights]
        busy = {self._group(n) for n in self.flights}
        return [n for n in nodes if self._group(n) not in busy]

    def _group(self, node: int) -> int:
        return self.partitions[node] % self.settings.groups

    # ----- dispatch ---------------------------------------------------------------------
    def dispatch(
        self,
        server_round: int,
        base: torch.Tensor,
        replies: list[Message],
        down: Mapping[int, Traffic],
        asked: Mapping[int, int],
        upload_parts: Callable[[int, int], UploadParts],
    ) -> list[int]:
        """Put this round's replies on the clock; return the nodes that sent none."""
        if down:
            self.bases[server_round] = base
        replied = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            if node not in down or node in replied:
                continue  # not asked this round, or a duplicate: never counted
            replied.add(node)
            up = payload_traffic(reply.content) if reply.has_content() else Traffic(0)
            samples, parts = asked[node], upload_parts(node, up.total)
            if reply.has_error():  # crashed: the server learns it once the work is due
                parts = ()
            elif reply.has_content():
                samples = _reported_samples(reply, samples)
            self.flights[node] = Flight(node, server_round, reply, up)
            job = Job(node, self.partitions[node], down[node].total, samples, parts)
            self.clock.submit(job)
        return sorted((n for n in down if n not in replied), key=self.partitions.__getitem__)

    # ----- close ------------------------------------------------------------------------
    def close(
        self,
        server_round: int,
        started_s: float,
        dispatched: int,
        missing: list[int],
        buffer_k: int | None = None,
    ) -> Landed:
        """Advance the clock to this round's close; return what lands in it.

        `missing`: nodes asked this round that sent no reply. A sync round still waits
        for them until its deadline (the server cannot know they will not come).
        `buffer_k`: the strategy's own semi-async close for this round, if it sets one.
        """
        kind = self.settings.kind
        until = started_s + self.deadline_s if self.timed else math.inf
        landed: list[Flight] = []
        given_up = list(missing)
        target = self._target(dispatched, len(missing), buffer_k)
        arrived = [f for f in self.flights.values() if f.arrived_s is not None]  # groups
        while True:
            if kind == "groups" and (group := self._complete_group(arrived)) is not None:
                landed = [f for f in arrived if self._group(f.node) == group]
                break
            if kind != "groups" and len(landed) >= target:
                break
            arrival = self.clock.next_arrival(until)
            if arrival is None:
                break
            flight = self.flights[arrival.key]
            if arrival.dropped:  # the device went offline: its reply never comes
                del self.flights[arrival.key]
                given_up.append(arrival.key)
                continue
            flight.arrived_s = arrival.arrived_s
            (arrived if kind == "groups" else landed).append(flight)
        if kind == "groups" and not landed and arrived and math.isfinite(until):
            landed = arrived  # deadline: whatever has arrived lands
        for flight in landed:
            del self.flights[flight.node]
        if kind == "sync" and self.settings.late == "drop":
            for node in sorted(self.flights):  # the rest of this round: stop waiting
                self.clock.cancel(node)
                given_up.append(node)
            self.flights.clear()
        return self._landed(server_round, landed, given_up)

    def _target(self, dispatched: int, missing: int, buffer_k: int | None) -> int:
        """Arrivals that close a round (sync, semi_async)."""
        settings = self.settings
        if settings.kind == "semi_async":
            k = buffer_k or settings.buffer_k or max(1, math.ceil(len(self.flights) / 2))
            return min(k, len(self.flights))
        if settings.first_k_fraction is not None:
            return math.ceil(settings.first_k_fraction * dispatched)
        return len(self.flights) + missing

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

    def _landed(self, server_round: int, flights: list[Flight], given_up: list[int]) -> Landed:
        flights.sort(key=lambda f: self.partitions[f.node])  # engine-independent order
        out = Landed(given_up=sorted(given_up, key=self.partitions.__getitem__))
        for flight in flights:
            out.replies.append(flight.reply)
            out.up.append(flight.up)
            out.info[flight.node] = ReplyInfo(
                sent_round=flight.sent_round,
                staleness=server_round - flight.sent_round,
                arrived_s=float(flight.arrived_s or 0.0),
                base=self.bases[flight.sent_round],
            )
        live = {f.sent_round for f in self.flights.values()}
        self.bases = {r: b for r, b in self.bases.items() if r in live or r == server_round}
        return out

    # ----- resume -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """In-flight replies (content as RecordDicts), their bases, and the clock."""
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
                }
                for node, f in self.flights.items()
            },
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
                node, int(saved["sent_round"]), reply, up, saved["arrived_s"]
            )


def _reported_samples(reply: Message, asked: int) -> int:
    """Samples the clock charges: what the reply reports, never more than was asked."""
    metrics = reply.content.metric_records.get("metrics")
    reported = metrics.get("samples") if metrics is not None else None
    if isinstance(reported, int) and not isinstance(reported, bool) and reported >= 0:
        return min(reported, asked)
    return asked


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
