"""The offer: what the server tells a node about its side channel, in every instruction.

It rides in the instruction as a ConfigRecord (under `OFFER`): which channel, the
address to dial, this instruction's token, the CA to trust when the channel uses TLS
(it arrives over Flower's own authenticated connection), and the limits the node must
keep. A node validates it like any other untrusted input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flwr.app import ConfigRecord

from fl.net.transport.reference import ReferenceError

__all__ = ["KINDS", "OFFER", "Offer"]

OFFER = "bulk-offer"
KINDS = ("grpc", "rdma")
_TOKEN = re.compile(r"[0-9a-f]{32}")
_PEER = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}")
_MAX_CHUNK = 64 * 2**20


@dataclass(frozen=True)
class Offer:
    """One instruction's side channel."""

    kind: str  # grpc | rdma
    peer: str  # host:port of the server's bulk service
    token: str  # lets this instruction's node fetch its blobs and upload one reply
    ca_pem: str  # the CA the service's certificate chains to; "" when it has no TLS
    min_bytes: int  # ArrayRecords at least this large go on the side channel
    chunk_bytes: int  # gRPC stream chunk size
    max_upload_bytes: int  # the largest reply blob the server accepts
    timeout_s: float  # per transfer

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "kind": self.kind,
                "peer": self.peer,
                "token": self.token,
                "ca": self.ca_pem,
                "min-bytes": self.min_bytes,
                "chunk-bytes": self.chunk_bytes,
                "max-upload-bytes": self.max_upload_bytes,
                "timeout-s": self.timeout_s,
            }
        )

    @classmethod
    def parse(cls, record: ConfigRecord) -> Offer:
        """Validate an offer; ReferenceError says what is wrong."""
        kind, peer, token, ca = (record.get(k) for k in ("kind", "peer", "token", "ca"))
        if kind not in KINDS:
            raise ReferenceError(f"offer kind {kind!r} is not one of {KINDS}")
        if not isinstance(peer, str) or not _PEER.fullmatch(peer):
            raise ReferenceError(f"offer peer {peer!r} is not host:port")
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise ReferenceError("offer token is not 32 lowercase hex digits")
        if not isinstance(ca, str) or (ca and not ca.startswith("-----BEGIN CERTIFICATE-----")):
            raise ReferenceError("offer ca is not a PEM certificate")
        ints = {}
        for key, low, high in (
            ("min-bytes", 0, 2**62),
            ("chunk-bytes", 1, _MAX_CHUNK),
            ("max-upload-bytes", 0, 2**62),
        ):
            value = record.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ReferenceError(f"offer {key} {value!r} is not in [{low}, {high}]")
            ints[key] = value
        timeout = record.get("timeout-s")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise ReferenceError(f"offer timeout-s {timeout!r} is not a positive number")
        return cls(
            str(kind),
            peer,
            token,
            ca,
            ints["min-bytes"],
            ints["chunk-bytes"],
            ints["max-upload-bytes"],
            float(timeout),
        )
