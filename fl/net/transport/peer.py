"""A node's side of the bulk channel: fetch a blob the server published, upload a reply.

`fetch` and `upload` dial the peer an `Offer` names (with its CA when it has one) and
move the bytes by gRPC stream or, for `rdma`, by a NIXL one-sided READ or WRITE set up
over gRPC. A peer that streams more bytes than the reference declares is cut off.
Errors surface as exceptions; the mod turns them into inline fallbacks. A ClientApp
process dials once per call; a node's sidecar keeps its channels (`Channels(keep=True)`)
and fetches straight into shared memory (`into`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import grpc

from fl.net.transport.digest import blob_digest
from fl.net.transport.nixl_link import Buffer, Region, agent
from fl.net.transport.offer import Offer
from fl.net.transport.reference import ReferenceError
from fl.net.transport.service import SERVICE, channel_options

__all__ = ["BlobId", "Channels", "fetch", "upload"]

MAX_CHANNELS = 16


class BlobId(Protocol):
    """What names a blob on the wire (a `Reference` is one)."""

    @property
    def sha256(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


class Channels:
    """gRPC channels to bulk services: a fresh one per call, or (`keep`) kept open and
    reused per peer, CA and chunk size, at most `MAX_CHANNELS`, the oldest closed first."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str, int], grpc.Channel] = {}

    @staticmethod
    def _dial(offer: Offer) -> grpc.Channel:
        options = channel_options(offer.chunk_bytes)
        if offer.ca_pem:
            credentials = grpc.ssl_channel_credentials(root_certificates=offer.ca_pem.encode())
            return grpc.secure_channel(offer.peer, credentials, options=options)
        return grpc.insecure_channel(offer.peer, options=options)

    @contextmanager
    def __call__(self, offer: Offer) -> Iterator[grpc.Channel]:
        if not self.keep:
            with self._dial(offer) as channel:
                yield channel
            return
        key = (offer.peer, offer.ca_pem, offer.chunk_bytes)
        with self._lock:
            channel = self._open.pop(key, None) or self._dial(offer)
            self._open[key] = channel  # (now the newest)
            while len(self._open) > MAX_CHANNELS:
                self._open.pop(next(iter(self._open))).close()
        yield channel

    def close(self) -> None:
        with self._lock:
            for channel in self._open.values():
                channel.close()
            self._open.clear()


def _call(channel: grpc.Channel, method: str, body: dict[str, Any], timeout: float) -> Any:
    """One JSON control call of the rdma path."""
    stub = channel.unary_unary(SERVICE + method)
    return json.loads(stub(json.dumps(body).encode(), timeout=timeout))


def fetch(
    offer: Offer,
    reference: BlobId,
    into: Buffer | None = None,
    channels: Channels | None = None,
) -> Buffer:
    """The blob `reference` names, from the offer's peer, in `into` (of exactly its size)
    or a new bytearray, once it matches the reference's SHA-256 digest."""
    buffer = bytearray(reference.nbytes) if into is None else into
    if len(buffer) != reference.nbytes:
        raise ValueError(f"a buffer of {len(buffer)} B for a blob of {reference.nbytes} B")
    with (channels or Channels())(offer) as channel:
        _receive(channel, offer, reference, buffer)
    if blob_digest(buffer) != reference.sha256:
        raise ReferenceError("blob does not match the reference's SHA-256")
    return buffer


def _receive(channel: grpc.Channel, offer: Offer, reference: BlobId, buffer: Buffer) -> None:
    """Fill `buffer` with the blob: a NIXL READ (rdma) or the service's gRPC stream."""
    ids = {"token": offer.token, "sha256": reference.sha256}
    if offer.kind == "rdma":
        region = Region.from_json(_call(channel, "Describe", ids, offer.timeout_s))
        agent().transfer("READ", buffer, region, offer.timeout_s)
        return
    stream = channel.unary_stream(SERVICE + "Fetch")(
        json.dumps(ids).encode(), timeout=offer.timeout_s
    )
    view, received = memoryview(buffer), 0
    for chunk in stream:
        if received + len(chunk) > reference.nbytes:
            stream.cancel()
            raise ReferenceError(f"peer sent more than the {reference.nbytes} B declared")
        view[received : received + len(chunk)] = chunk
        received += len(chunk)
    if received != reference.nbytes:
        raise ReferenceError(f"peer sent {received} of {reference.nbytes} declared bytes")


def _chunks(blob: Buffer, size: int) -> Iterator[bytes]:
    view = memoryview(blob)
    for start in range(0, len(blob), size):
        yield bytes(view[start : start + size])


def upload(offer: Offer, reference: BlobId, blob: Buffer, channels: Channels | None = None) -> None:
    """Send a reply blob to the offer's peer; it checks the SHA-256 before accepting."""
    if len(blob) > offer.max_upload_bytes:
        raise ReferenceError(f"reply blob of {len(blob)} B exceeds the server's limit")
    with (channels or Channels())(offer) as channel:
        if offer.kind == "rdma":
            ids = {"token": offer.token, "sha256": reference.sha256, "nbytes": len(blob)}
            region = Region.from_json(_call(channel, "Reserve", ids, offer.timeout_s))
            agent().transfer("WRITE", blob, region, offer.timeout_s)
            _call(channel, "Commit", {"token": offer.token}, offer.timeout_s)
            return
        metadata = (
            ("token", offer.token),
            ("sha256", reference.sha256),
            ("nbytes", str(len(blob))),
        )
        channel.stream_unary(SERVICE + "Store")(
            _chunks(blob, offer.chunk_bytes), metadata=metadata, timeout=offer.timeout_s
        )
