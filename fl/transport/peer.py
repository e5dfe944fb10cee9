"""A node's side of the bulk channel: fetch a blob the server published, upload a reply.

`fetch` and `upload` dial the peer an `Offer` names (with its CA when it has one) and
move the bytes by gRPC stream or, for `rdma`, by a NIXL one-sided READ or WRITE set up
over gRPC. A peer that streams more bytes than the reference declares is cut off.
Errors surface as exceptions; the mod turns them into inline fallbacks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc

from fl.transport.nixl_link import Region, agent
from fl.transport.offer import Offer
from fl.transport.reference import Reference, ReferenceError
from fl.transport.service import SERVICE, channel_options

__all__ = ["fetch", "upload"]


def _channel(offer: Offer) -> grpc.Channel:
    options = channel_options(offer.chunk_bytes)
    if offer.ca_pem:
        credentials = grpc.ssl_channel_credentials(root_certificates=offer.ca_pem.encode())
        return grpc.secure_channel(offer.peer, credentials, options=options)
    return grpc.insecure_channel(offer.peer, options=options)


def _call(channel: grpc.Channel, method: str, body: dict[str, Any], timeout: float) -> Any:
    """One JSON control call of the rdma path."""
    stub = channel.unary_unary(SERVICE + method)
    return json.loads(stub(json.dumps(body).encode(), timeout=timeout))


def fetch(offer: Offer, reference: Reference) -> bytearray:
    """The blob `reference` names, from the offer's peer (not yet checksummed)."""
    ids = {"token": offer.token, "sha256": reference.sha256}
    buffer = bytearray(reference.nbytes)
    with _channel(offer) as channel:
        if offer.kind == "rdma":
            region = Region.from_json(_call(channel, "Describe", ids, offer.timeout_s))
            agent().transfer("READ", buffer, region, offer.timeout_s)
            return buffer
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
    return buffer


def _chunks(blob: bytearray, size: int) -> Iterator[bytes]:
    view = memoryview(blob)
    for start in range(0, len(blob), size):
        yield bytes(view[start : start + size])


def upload(offer: Offer, reference: Reference, blob: bytearray) -> None:
    """Send a reply blob to the offer's peer; it checks the SHA-256 before accepting."""
    if len(blob) > offer.max_upload_bytes:
        raise ReferenceError(f"reply blob of {len(blob)} B exceeds the server's limit")
    with _channel(offer) as channel:
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
