"""The ClientApp's half of the side channel: a Flower mod `(msg, context, call_next)`.

An instruction with an offer has its referenced arrays fetched (and checked against
their SHA-256) before the ClientApp sees it; the reply's large arrays are uploaded and
replaced by a reference. The bytes move through the node's bulk agent when the node
config names one (`bulk-agent=PATH`, `fl.net.transport.sidecar`), else from this process
(`fl.net.transport.links`). When the fetch fails the node answers `bulk-retry` and the
server sends the instruction again inline; when the upload fails the reply goes inline
with a `bulk-report`. An instruction without an offer passes through untouched.
"""

from __future__ import annotations

import logging

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fl.net.transport.grid import REPORT, RETRY
from fl.net.transport.links import node_link
from fl.net.transport.offer import OFFER, Offer
from fl.net.transport.reference import REFERENCE, Packer, Reference, unpack
from fl.wire.records import record_of

__all__ = ["bulk_mod"]

log = logging.getLogger(__name__)
REASON_CHARS = 500


def _reason(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:REASON_CHARS]


def bulk_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Fetch an instruction's arrays from the side channel; send the reply's back on it."""
    offer_record = record_of(msg.content, OFFER, ConfigRecord) if msg.has_content() else None
    if offer_record is None:
        return call_next(msg, context)
    content = RecordDict({k: v for k, v in msg.content.items() if k != OFFER})
    link = node_link(context)
    try:
        offer = Offer.parse(offer_record)
        reference_record = record_of(content, REFERENCE, ConfigRecord)
        if reference_record is not None:
            reference = Reference.parse(reference_record)
            with link.fetch(offer, reference) as blob:  # its SHA-256 checked
                content = unpack(content, reference, blob, hashed=True)
    except Exception as err:  # any failure of the side channel: ask for the inline copy
        log.warning("bulk fetch failed, asking for the arrays inline: %s", _reason(err))
        return Message(RecordDict({RETRY: ConfigRecord({"reason": _reason(err)})}), reply_to=msg)
    msg.content = content
    reply = call_next(msg, context)
    if not reply.has_content():
        return reply
    try:
        with link.upload(offer) as outgoing:
            packed = Packer(offer.min_bytes).pack(reply.content, outgoing.allocate)
            if packed is None:
                return reply
            rest, reference, blob = packed
            outgoing.send(reference, blob)
            del packed, blob  # (the blob's memory is the link's until the `with` ends)
    except Exception as err:  # any failure of the side channel: the reply goes inline
        log.warning("bulk upload failed, replying inline: %s", _reason(err))
        reply.content[REPORT] = ConfigRecord({"fallback": _reason(err)})
        return reply
    rest[REFERENCE] = reference.to_record()
    reply.content = rest
    return reply
