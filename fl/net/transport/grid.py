"""The ServerApp's half of the side channel: a `Grid` wrapper that sends large arrays aside.

`BulkGrid` wraps the engine's Grid. Each instruction it pushes gets an offer (a token
for this instruction, the service's address and CA); its large ArrayRecords are published
in the bulk service and replaced by a reference. Replies come back with their large
arrays already uploaded: the wrapper swaps each reference for the verified upload, so
the round loop and the strategy see exactly the message the node would have sent inline.

Fallbacks, all counted (`diagnostics`, in every metrics row) and logged:
- a node that cannot fetch its arrays answers `bulk-retry`; the instruction is pushed
  again, inline, and the node's next answer is the reply;
- a node that cannot upload sends its reply inline with a `bulk-report` saying why;
- a reply whose reference does not resolve to a verified upload becomes an error reply
  (the strategy counts it as failed; training on it is impossible).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.serverapp import Grid

from fl.common.text import shown
from fl.net.transport.offer import OFFER, Offer
from fl.net.transport.reference import REFERENCE, Packer, Reference, ReferenceError, unpack
from fl.net.transport.service import BulkService
from fl.net.transport.store import BlobStore, StoreError
from fl.wire.grids import DelegatingGrid

__all__ = ["REPORT", "RETRY", "BulkGrid", "TransportSettings"]

log = logging.getLogger(__name__)
RETRY = "bulk-retry"  # a node's answer: "I could not fetch the arrays; send them inline"
REPORT = "bulk-report"  # in a reply sent inline because its upload failed: why
BULK_FAILED = 6  # flwr ErrorCode.MOD_FAILED_PRECONDITION
POLL_S = 0.05


@dataclass(frozen=True)
class TransportSettings:
    """`conf/transport/NAME.yaml`: which side channel, where it listens, its limits."""

    name: str = "inline"  # inline | grpc | rdma
    listen: str = "127.0.0.1:0"  # the bulk service's address (port 0: any free port)
    advertise: str | None = None  # the address nodes dial (null: listen's host, bound port)
    tls: bool = False  # serve the side channel over TLS (see `from_config`)
    min_bytes: int = 2**20  # ArrayRecords at least this large travel aside
    chunk_bytes: int = 4 * 2**20
    max_upload_bytes: int = 16 * 2**30
    timeout_s: float = 300.0
    ttl_s: float = 3600.0  # an unanswered instruction's blobs are freed after this

    @classmethod
    def from_config(cls, cfg: Any) -> TransportSettings:
        """The run's `transport` group; `tls: auto` follows the engine (`insecure: false`)."""
        values = dict(cfg.get("transport") or {"name": "inline"})
        tls = values.pop("tls", "auto")
        if tls == "auto":
            tls = cfg.get("engine", {}).get("insecure") is False
        if not isinstance(tls, bool):
            raise ValueError(f"transport.tls must be auto, true or false, got {tls!r}")
        settings = cls(**values, tls=tls)
        if settings.name not in ("inline", "grpc", "rdma"):
            raise ValueError(f"transport.name must be inline, grpc or rdma, got {settings.name!r}")
        return settings


@dataclass
class _Sent:
    """An instruction in flight: the original, its token and the id it now travels under."""

    message: Message
    token: str
    inner_id: str
    retried: bool = False


class BulkGrid(DelegatingGrid):
    """`grid` with large arrays moved over the bulk service (see the module docstring)."""

    def __init__(self, grid: Grid, settings: TransportSettings) -> None:
        super().__init__(grid)
        self.settings = settings
        self.store = BlobStore(settings.max_upload_bytes, settings.ttl_s)
        self.service = BulkService(
            self.store,
            listen=settings.listen,
            advertise=settings.advertise,
            tls=settings.tls,
            chunk_bytes=settings.chunk_bytes,
            rdma=settings.name == "rdma",
            upload_timeout_s=settings.timeout_s,
        )
        self.packer = Packer(settings.min_bytes)
        self.counts: Counter[str] = Counter()
        self._sent: dict[str, _Sent] = {}  # by the id the caller knows

    # ----- instructions -----------------------------------------------------------------
    def _offer(self, token: str) -> ConfigRecord:
        s = self.settings
        return Offer(
            s.name,
            self.service.address,
            token,
            self.service.ca_pem,
            s.min_bytes,
            s.chunk_bytes,
            s.max_upload_bytes,
            s.timeout_s,
        ).to_record()

    def _aside(self, message: Message) -> tuple[Message, str]:
        """The instruction as it travels, and its token."""
        token = self.store.issue()
        packed = self.packer.pack(message.content)
        content = RecordDict(dict(message.content.items()))
        if packed is not None:
            content, reference, blob = packed
            self.store.publish(token, reference.sha256, blob)
            content[REFERENCE] = reference.to_record()
            self.counts["bulk_down"] += 1
        content[OFFER] = self._offer(token)
        return _copy(message, content), token

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        # instructions never answered (given up on) are forgotten once their token expires
        self._sent = {k: v for k, v in self._sent.items() if self.store.live(v.token)}
        originals = list(messages)
        aside = [self._aside(m) for m in originals]
        self.packer.forget()
        ids = list(self.inner.push_messages([m for m, _ in aside]))
        for original, (_, token), inner_id in zip(originals, aside, ids, strict=True):
            if inner_id:  # (HttpGrid returns None for a message it could not push)
                self._sent[inner_id] = _Sent(original, token, inner_id)
            else:
                self.store.release(token)
        return ids

    # ----- replies ----------------------------------------------------------------------
    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        outer = {self._sent[i].inner_id if i in self._sent else i: i for i in message_ids}
        landed = []
        for reply in self.inner.pull_messages(list(outer)):
            caller_id = outer.get(reply.metadata.reply_to_message_id, "")
            sent = self._sent.get(caller_id)
            if sent is None:  # not sent through this wrapper
                landed.append(reply)
                continue
            if reply.has_content() and RETRY in reply.content.config_records and not sent.retried:
                self._retry(sent, reply)
                continue
            del self._sent[caller_id]
            reply.metadata.__dict__["_reply_to_message_id"] = caller_id  # the id it was sent as
            landed.append(self._restore(reply, sent) if reply.has_content() else reply)
            self.store.release(sent.token)
        return landed

    def _retry(self, sent: _Sent, reply: Message) -> None:
        """The node could not fetch its arrays: push the original instruction inline."""
        reason = shown(reply.content.config_records[RETRY].get("reason", ""))
        log.warning("node %d could not fetch its arrays (%s): sent inline", _src(reply), reason)
        self.counts["bulk_fallbacks"] += 1
        self.store.release(sent.token)
        (inner_id,) = self.inner.push_messages([_copy(sent.message, sent.message.content)])
        # a fresh token, never offered: it only keeps the retry in `_sent` until it expires
        sent.inner_id, sent.retried, sent.token = inner_id, True, self.store.issue()

    def _restore(self, reply: Message, sent: _Sent) -> Message:
        """The reply as its node would have sent it inline (or an error reply)."""
        content = reply.content
        if REPORT in content.config_records:  # its upload failed: the arrays came inline
            reason = content.config_records[REPORT].get("fallback", "")
            log.warning(
                "node %d could not upload its reply (%s): came inline", _src(reply), shown(reason)
            )
            self.counts["bulk_fallbacks"] += 1
            reply.content = RecordDict({k: v for k, v in content.items() if k != REPORT})
            return reply
        if REFERENCE not in content.config_records:
            return reply
        try:
            reference = Reference.parse(
                content.config_records[REFERENCE], self.settings.max_upload_bytes
            )
            blob = self.store.take_upload(sent.token, reference.sha256)  # checked on arrival
            reply.content = unpack(content, reference, blob, hashed=True)
        except (ReferenceError, StoreError) as err:
            log.warning("node %d: reply reference refused: %s", _src(reply), shown(err))
            self.counts["bulk_refused"] += 1
            reply.__dict__["_content"] = None  # Message forbids content and error together
            reply.error = Error(BULK_FAILED, f"bulk reference refused: {shown(err)}")
            return reply
        self.counts["bulk_up"] += 1
        return reply

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull until every reply (retries included) is in or `timeout` passes.

        An engine that answers in the pull itself (`synchronous`, the local engine) will
        never bring a reply it did not bring then: only instructions re-pushed during that
        pull (a node's retry inline) are waited for, once more.
        """
        waiting = set(self.push_messages(messages)) - {""}
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        synchronous = bool(getattr(self.inner, "synchronous", False))
        replies: list[Message] = []
        retried: set[str] = set()  # (synchronous engines) retries already pulled once
        while waiting:
            landed = list(self.pull_messages(sorted(waiting)))
            replies += landed
            waiting -= {r.metadata.reply_to_message_id for r in landed}
            if synchronous:
                waiting = {i for i in waiting if i in self._sent and self._sent[i].retried}
                waiting -= retried
                retried |= waiting
            if not waiting or time.monotonic() >= deadline:
                break
            if not landed:
                time.sleep(POLL_S)
        return replies

    def diagnostics(self) -> dict[str, int]:
        """Counts since the last call: instructions and replies whose arrays went aside,
        inline fallbacks, refused reply references; and `bulk_tls` 1 when the service
        serves TLS only (so every transfer counted went over TLS)."""
        keys = ("bulk_down", "bulk_up", "bulk_fallbacks", "bulk_refused")
        out = {key: self.counts[key] for key in keys}
        self.counts.clear()
        return out | {"bulk_tls": int(self.settings.tls)}

    def close(self) -> None:
        """Stop the bulk service."""
        self.service.stop()

    # ----- the engine's own extras, delegated ---------------------------------------------
    def __getattr__(self, name: str) -> Any:  # the engine's own extras (state_dict, ...)
        if name == "inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def _copy(message: Message, content: RecordDict) -> Message:
    meta = message.metadata
    return Message(
        content, meta.dst_node_id, meta.message_type, ttl=meta.ttl, group_id=meta.group_id
    )


def _src(reply: Message) -> int:
    return int(reply.metadata.src_node_id)
