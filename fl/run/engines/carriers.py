"""Cohorts on an engine whose nodes take one message at a time (`engine=flower-sim`).

Flower's simulation hands each Ray actor one message for one node. With
`engine.cohort=auto` the server packs a round's train instructions into `engine.cohorts`
envelopes, one per carrier node; the carrier's ClientApp trains its members as one cohort
(`clients.app.carry_cohort`) and answers with every member's reply inside its own.
`CarrierGrid` opens those replies into the members' own, as if each node had answered,
so the round loop, the virtual clock and the byte counts never see an envelope. Where
the loop takes it (`takes_cohort_replies`), the carrier answers its plain members with
one cohort reply (`fl.wire.cohort_reply`) under `batch/`, opened as that one Message.

A member's `Context.state` lives with its carrier: partition p always travels with the
node holding partition p mod `cohorts`, which keeps each member's state under the
member's node id. So the split is fixed by the config, never by the core count, and a run
gives the same numbers on any machine.

An envelope's reply is a client's word like any other: a key that names no member, or an
error list that does not fit, turns every member of that envelope into an error reply.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, Metadata, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from omegaconf import DictConfig

from fl.common.config import plain
from fl.common.text import shown
from fl.run.faults import group_injects
from fl.strategy.registry import get_strategy
from fl.strategy.server import ServerStrategy
from fl.wire.grids import DelegatingGrid

__all__ = [
    "ENVELOPE",
    "CarrierGrid",
    "Member",
    "Sealed",
    "carrier_grid",
    "expects_cohort_replies",
    "is_envelope",
    "keep_member_states",
    "member_context",
    "member_states",
    "open_envelope",
    "open_replies",
    "seal_envelope",
    "seal_replies",
    "takes_cohort_replies",
    "wants_one_reply",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
ENVELOPE = "cohort"  # the ConfigRecord that makes a train message an envelope
ONE_REPLY = "one-reply"  # in its header: the carrier may answer with one cohort reply
BATCH = "batch"  # a carrier's reply holds that cohort reply's records under `batch/`
PATH_CHARS = 200  # a carrier's account of its path is logged, never longer than this
# (escaped too: `fl.common.text.shown`, as every reason a reply carries)


def carrier_grid(grid: Grid, cfg: DictConfig, partitions: Mapping[int, int], arrival: str) -> Grid:
    """`grid` wrapped in a `CarrierGrid` when the run trains cohorts on carriers, else
    `grid` itself, with a log line saying why not where the run asked for cohorts."""
    engine = cfg.engine
    if engine.name != "flower-sim" or engine.get("cohort", "off") != "auto":
        return grid
    why_not = None
    if arrival != "virtual":
        why_not = "replies arrive as they reach the server (loop.arrival=real)"
    elif group_injects(plain(cfg.get("faults") or {})):
        why_not = "faults or attacks are injected message by message"
    elif cfg.transport.name != "inline":
        why_not = f"transport={cfg.transport.name} brings arrays beside each message"
    if why_not is not None:
        log.info("flower-sim: train messages go node by node: %s", why_not)
        return grid
    log.info("flower-sim: train messages go as up to %d cohorts (engine.cohorts)", engine.cohorts)
    return CarrierGrid(grid, partitions, int(engine.cohorts), takes_cohort_replies(cfg))


def takes_cohort_replies(cfg: DictConfig) -> bool:
    """Whether our round loop takes a cohort's one reply (`fl.wire.cohort_reply`) in this
    run: `sync` rounds that drop late replies on the virtual clock (no reply outlives its
    round, so none is held or checkpointed in flight), no privacy mechanism, inline
    transport, and a server half that decodes replies and times their uploads as
    `ServerStrategy` does. Elsewhere every cohort member replies on its own."""
    loop = cfg.loop
    if cfg.privacy.name != "none" or cfg.transport.get("name", "inline") != "inline":
        return False
    if loop.kind != "sync" or loop.late != "drop" or loop.get("arrival") not in (None, "virtual"):
        return False
    server = get_strategy(str(cfg.strategy.name)).server
    return all(
        getattr(server, name) is getattr(ServerStrategy, name)
        for name in ("decode_reply", "reply_parts", "upload_parts")
    )


def expects_cohort_replies(cfg: DictConfig) -> bool:
    """Whether a cohort's one reply can come in this run at all: an engine that trains
    cohorts in process (local, or flower-sim's carriers) with `engine.cohort=auto`, in a
    run `takes_cohort_replies` names. Elsewhere (a deployment's SuperNodes) a reply shaped
    as a cohort's would let one node answer for others, so it is refused."""
    engine = cfg.engine
    in_process = engine.name in ("local", "flower-sim") and engine.get("cohort") == "auto"
    return in_process and takes_cohort_replies(cfg)


@dataclass(frozen=True)
class Sealed:
    """An envelope as sent, with the member messages it carries, in order."""

    envelope: Message
    members: list[Message]


class CarrierGrid(DelegatingGrid):
    """`grid` with a round's train messages sent as envelopes to carrier nodes.

    Only `send_and_receive` (the virtual clock's dispatch) packs; every other message and
    every other call goes to `grid` unchanged.
    """

    def __init__(
        self, grid: Grid, partitions: Mapping[int, int], cohorts: int, one_reply: bool = False
    ) -> None:
        """`one_reply`: a carrier may answer its cohort's plain members with one cohort
        reply (`fl.wire.cohort_reply`), where the run's loop takes it."""
        super().__init__(grid)
        self.partitions = dict(partitions)
        self.cohorts = cohorts
        self.one_reply = one_reply
        by_partition = {p: node for node, p in self.partitions.items()}
        self.carriers = [by_partition[c] for c in range(min(cohorts, len(by_partition)))]
        self.num_partitions = len(by_partition)
        self.paths: tuple[str, ...] = ()  # what the last envelopes' carriers did, in words
        self._ids = itertools.count(1)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        trains = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        others = [m for m in messages if m.metadata.message_type != MessageType.TRAIN]
        sealed = self._seal(trains)
        outgoing = [*others, *(s.envelope for s in sealed)]
        replies = list(self.inner.send_and_receive(outgoing, timeout=timeout))
        by_id = {s.envelope.metadata.message_id: s for s in sealed}
        opened: list[Message] = []
        paths: list[str] = []
        for reply in replies:
            envelope = by_id.pop(reply.metadata.reply_to_message_id, None)
            if envelope is None:
                opened.append(reply)
                continue
            members, path = open_replies(reply, envelope.members)
            opened.extend(members)
            paths.append(path)
        if paths and tuple(sorted(set(paths))) != self.paths:
            self.paths = tuple(sorted(set(paths)))
            log.info(
                "flower-sim: %d train messages on carriers, %s", len(trains), "; ".join(self.paths)
            )
        return opened

    def _seal(self, trains: Sequence[Message]) -> list[Sealed]:
        """One envelope per carrier that has members, each member's id set as if pushed."""
        groups: dict[int, list[Message]] = {}
        for message in trains:
            partition = self.partitions[message.metadata.dst_node_id]
            groups.setdefault(partition % self.cohorts, []).append(message)
        sealed = []
        for carrier, members in sorted(groups.items()):
            envelope = seal_envelope(
                members,
                self.carriers[carrier],
                self.partitions,
                self.num_partitions,
                one_reply=self.one_reply,
            )
            envelope_id = f"envelope-{next(self._ids)}"
            for j, member in enumerate(members):
                member.metadata.__dict__["_message_id"] = f"{envelope_id}/{j}"
            sealed.append(Sealed(envelope, members))
        return sealed


def is_envelope(message: Message) -> bool:
    """Whether a train message carries other nodes' instructions."""
    return message.has_content() and ENVELOPE in message.content


def seal_envelope(
    members: Sequence[Message],
    carrier: int,
    partitions: Mapping[int, int],
    num_partitions: int,
    *,
    one_reply: bool = False,
) -> Message:
    """A train message to `carrier` holding each member's records under `j/` (`one_reply`:
    its plain members may answer in one cohort reply)."""
    content = RecordDict()
    for j, member in enumerate(members):
        for name, record in member.content.items():
            content[f"{j}/{name}"] = record
    nodes = [m.metadata.dst_node_id for m in members]
    content[ENVELOPE] = ConfigRecord(
        {
            "nodes": [str(node) for node in nodes],  # node ids may not fit a signed int64
            "partitions": [partitions[node] for node in nodes],
            "num-partitions": num_partitions,
            ONE_REPLY: one_reply,
        }
    )
    first = members[0].metadata
    return Message(content, carrier, MessageType.TRAIN, ttl=first.ttl, group_id=first.group_id)


@dataclass(frozen=True)
class Member:
    """One member of an envelope as its carrier sees it."""

    node: int
    partition: int
    num_partitions: int
    message: Message


def open_envelope(envelope: Message) -> list[Member]:
    """The members an envelope carries, each as the train message its node would get."""
    content = envelope.content
    header = content[ENVELOPE]
    if not isinstance(header, ConfigRecord):
        raise ValueError(f"an envelope's {ENVELOPE!r} must be a ConfigRecord")
    count = header.get("num-partitions")
    if not isinstance(count, int) or count < 1:
        raise ValueError("an envelope's header must give num-partitions >= 1")
    listed = _listed(header, "nodes", str)
    nodes = [int(node) for node in listed if node.isdigit()]
    partitions = [p for p in _listed(header, "partitions", int) if 0 <= p < count]
    if not len(listed) == len(nodes) == len(partitions):
        raise ValueError("an envelope's header must list node ids and partitions alike")
    records = _by_member(content, len(nodes))
    return [
        Member(node, partition, count, _as_sent_to(envelope, node, j, records[j]))
        for j, (node, partition) in enumerate(zip(nodes, partitions, strict=True))
    ]


def wants_one_reply(envelope: Message) -> bool:
    """Whether the server takes one cohort reply for an envelope's plain members."""
    header = envelope.content[ENVELOPE]
    return isinstance(header, ConfigRecord) and header.get(ONE_REPLY) is True


def _as_sent_to(envelope: Message, node: int, j: int, content: RecordDict) -> Message:
    """Member j's train message as its node would receive it: the envelope's metadata,
    its own destination and id (built whole: a Ray actor has no run identity to stamp)."""
    sent = envelope.metadata
    metadata = Metadata(
        run_id=sent.run_id,
        message_id=f"{sent.message_id}/{j}",
        src_node_id=sent.src_node_id,
        dst_node_id=node,
        reply_to_message_id="",
        group_id=sent.group_id,
        created_at=sent.created_at,
        ttl=sent.ttl,
        message_type=MessageType.TRAIN,
        src_task_id=sent.src_task_id,
        dst_task_id=sent.dst_task_id,
    )
    return Message(content, metadata=metadata)  # type: ignore[call-overload]


def _by_member(content: RecordDict, count: int) -> list[RecordDict]:
    """Records under `j/` regrouped per member j < count; any other key is a ValueError."""
    records = [RecordDict() for _ in range(count)]
    for key, record in content.items():
        head, slash, name = key.partition("/")
        if key == ENVELOPE or head == BATCH:
            continue
        if not (slash and name and head.isdigit() and int(head) < count):
            raise ValueError(f"key {key[:40]!r} names no member of {count}")
        records[int(head)][name] = record
    return records


def member_states(carrier: Context) -> dict[int, RecordDict]:
    """The members' states a carrier keeps, by node id, in one pass over its state."""
    states: dict[int, RecordDict] = {}
    for key, record in carrier.state.items():
        node, slash, name = key.partition("/")
        if slash and node.isdigit():
            states.setdefault(int(node), RecordDict())[name] = record
    return states


def member_context(carrier: Context, member: Member, states: dict[int, RecordDict]) -> Context:
    """The member's Context as its own node would hold it. Its state is the one `states`
    (`member_states`) holds for it, so what training changes there `keep_member_states`
    writes back."""
    return Context(
        run_id=carrier.run_id,
        node_id=member.node,
        node_config={"partition-id": member.partition, "num-partitions": member.num_partitions},
        state=states.setdefault(member.node, RecordDict()),
        run_config=carrier.run_config,
    )


def keep_member_states(carrier: Context, states: Mapping[int, RecordDict]) -> None:
    """Replace the members' states the carrier keeps with `states` (an emptied one: gone)."""
    for key in [key for key in carrier.state if key.partition("/")[0].isdigit()]:
        del carrier.state[key]
    for node, state in states.items():
        for name, record in state.items():
            carrier.state[f"{node}/{name}"] = record


def seal_replies(
    envelope: Message,
    replies: Sequence[Message | None],
    path: str,
    batch: RecordDict | None = None,
) -> Message:
    """The carrier's one reply: each member's reply records under `j/`, its errors listed,
    a member with no reply left out; `batch`, the cohort reply of the members it answers
    together (their entries None), under `batch/`."""
    content = RecordDict()
    for name, record in (batch or {}).items():
        content[f"{BATCH}/{name}"] = record
    errors: dict[str, list[Any]] = {"members": [], "codes": [], "reasons": []}
    for j, reply in enumerate(replies):
        if reply is None:
            continue
        if reply.has_error():
            errors["members"].append(j)
            errors["codes"].append(int(reply.error.code))
            errors["reasons"].append(str(reply.error.reason))
            continue
        for name, record in reply.content.items():
            content[f"{j}/{name}"] = record
    content[ENVELOPE] = ConfigRecord({"path": path, **{f"error-{k}": v for k, v in errors.items()}})
    return Message(content, reply_to=envelope)


def open_replies(reply: Message, members: Sequence[Message]) -> tuple[list[Message], str]:
    """The members' replies inside a carrier's reply, and the carrier's path in words.

    A carrier that failed, or answered in any other shape, fails every member it carried.
    """
    if reply.has_error():
        reason = f"its carrier failed: {shown(reply.error.reason)}"
        return [Message(Error(reply.error.code, reason), reply_to=m) for m in members], "failed"
    try:
        header = reply.content[ENVELOPE]
        if not isinstance(header, ConfigRecord):
            raise ValueError(f"{ENVELOPE!r} must be a ConfigRecord")
        records = _by_member(reply.content, len(members))
        failed = _errors(header, len(members))
        path = header.get("path")
        path = shown(path, PATH_CHARS) if isinstance(path, str) else "?"
    except (KeyError, ValueError) as err:
        reason = f"malformed reply from its carrier: {err}"
        return [
            Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=m)
            for m in members
        ], "malformed"
    opened = []
    for j, member in enumerate(members):
        if j in failed:
            opened.append(Message(Error(*failed[j]), reply_to=member))
        elif len(records[j]):
            opened.append(Message(records[j], reply_to=member))
    batch = RecordDict()
    for key, record in reply.content.items():
        head, _, name = key.partition("/")
        if head == BATCH and name:
            batch[name] = record
    if len(batch):  # the members it names are checked where it lands (RoundDriver.dispatch)
        opened.append(Message(batch, reply_to=members[0]))
    return opened, path


def _listed(header: ConfigRecord, key: str, kind: type[T]) -> list[T]:
    """`header[key]` as a list of `kind` (absent: empty); anything else is a ValueError."""
    value = header.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"{key!r} must be a list of {kind.__name__}")
    values: list[Any] = value
    items = [item for item in values if isinstance(item, kind) and not isinstance(item, bool)]
    if len(items) != len(values):
        raise ValueError(f"{key!r} must be a list of {kind.__name__}")
    return items


def _errors(header: ConfigRecord, count: int) -> dict[int, tuple[int, str]]:
    """member -> (code, reason) from a reply's header; a list that does not fit: ValueError."""
    members = _listed(header, "error-members", int)
    codes = _listed(header, "error-codes", int)
    reasons = _listed(header, "error-reasons", str)
    if not (
        len(members) == len(codes) == len(reasons) == len(set(members))
        and all(0 <= j < count for j in members)
    ):
        raise ValueError("its error lists do not fit its members")
    return {j: (c, shown(r)) for j, c, r in zip(members, codes, reasons, strict=True)}
