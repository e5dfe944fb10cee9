"""The ServerApp's bulk service: a grpcio server that nodes fetch blobs from and upload to.

Four calls, raw bytes (no protobuf of ours): `Fetch` streams a published blob in chunks,
`Store` takes a client stream of chunks as one reply blob, and for `transport=rdma` the
control calls `Describe` (where a blob lies for a one-sided NIXL READ) and `Reserve` /
`Commit` (a registered buffer the node WRITEs its reply into, then its checksum check).
An upload that sends more bytes than it declared is cut off at the first excess chunk.
With `tls`, the service makes its own CA and certificate for the advertised host at start;
the CA reaches nodes inside the offer, over Flower's own TLS connection.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from cryptography.hazmat.primitives import serialization

from fl.common.errors import RunError
from fl.net.tls import make_ca, make_server_cert
from fl.net.transport.nixl_link import Agent
from fl.net.transport.store import BlobStore, StoreError

__all__ = ["METHODS", "BulkService", "channel_options"]

log = logging.getLogger(__name__)
SERVICE = "/fl.transport.Bulk/"  # the wire name of the service: stable across releases
METHODS = ("Fetch", "Store", "Describe", "Reserve", "Commit")
_DIGITS = re.compile(r"[0-9]{1,20}")


def channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC limits that let one chunk (plus framing) through."""
    limit = chunk_bytes + 2**20
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


def _tls_credentials(host: str) -> tuple[grpc.ServerCredentials, str]:
    """Server credentials for `host` from a fresh CA, and that CA's PEM."""
    ca = make_ca("fl bulk channel CA", days=30)
    key, cert = make_server_cert(ca, [host], days=30)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    ca_pem = ca[1].public_bytes(serialization.Encoding.PEM).decode()
    return grpc.ssl_server_credentials([(key_pem, cert_pem)]), ca_pem


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


class BulkService:
    """The running service: `address` to advertise, `ca_pem` ("" without TLS), `stop()`."""

    def __init__(
        self,
        store: BlobStore,
        *,
        listen: str,
        advertise: str | None,
        tls: bool,
        chunk_bytes: int,
        rdma: bool = False,
        workers: int = 8,
        upload_timeout_s: float = 300.0,
    ) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.upload_timeout_s = upload_timeout_s
        # uploads get at most half the workers: slow uploaders never block every fetch
        self._upload_slots = threading.BoundedSemaphore(max(1, workers // 2))
        self.agent = Agent() if rdma else None  # a raises TransportUnavailable without NIXL
        self._reserved: dict[str, tuple[str, bytearray]] = {}  # token -> (sha256, buffer)
        self._published: dict[str, bytearray] = {}  # sha256 -> blob registered with NIXL
        self._lock = threading.Lock()  # the two dicts above, across the server's threads
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers), options=channel_options(chunk_bytes)
        )
        handlers: dict[str, grpc.RpcMethodHandler] = {
            "Fetch": grpc.unary_stream_rpc_method_handler(self._fetch),
            "Store": grpc.stream_unary_rpc_method_handler(self._store),
        }
        if rdma:
            handlers.update(
                {
                    name: grpc.unary_unary_rpc_method_handler(self._json(method))
                    for name, method in (
                        ("Describe", self._describe),
                        ("Reserve", self._reserve),
                        ("Commit", self._commit),
                    )
                }
            )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("fl.transport.Bulk", handlers),)
        )
        host = _host(advertise or listen)
        self.ca_pem = ""
        try:
            if tls:
                credentials, self.ca_pem = _tls_credentials(host)
                port = self._server.add_secure_port(listen, credentials)
            else:
                port = self._server.add_insecure_port(listen)
        except (
            RuntimeError
        ):  # grpc's "Failed to bind": an address not of this machine, a port in use
            port = 0
        if port == 0:
            raise RunError(
                f"transport.listen={listen}: the bulk service cannot listen there (an address "
                "of this machine and a free port, e.g. 0.0.0.0:0)"
            )
        self.address = advertise or f"{listen.rsplit(':', 1)[0]}:{port}"
        self._server.start()
        log.info("bulk service (%s%s) on %s", "rdma" if rdma else "grpc", " + TLS" * tls, listen)

    def stop(self) -> None:
        self._server.stop(grace=None)

    # ----- byte streams ------------------------------------------------------------------
    def _fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        token, sha = self._ids(request, context)
        try:
            blob = self.store.blob(token, sha)
        except StoreError as err:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        view = memoryview(blob)
        for start in range(0, len(blob), self.chunk_bytes):
            yield bytes(view[start : start + self.chunk_bytes])

    def _store(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        meta = dict(context.invocation_metadata())
        token, sha, size = (str(meta.get(k, "")) for k in ("token", "sha256", "nbytes"))
        if not _DIGITS.fullmatch(size):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "nbytes is not a number")
        nbytes = int(size)
        if not self._upload_slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many uploads under way")
        try:
            self.store.begin_upload(token, nbytes)
        except StoreError as err:
            self._upload_slots.release()
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        # a peer that trickles is cut off: the stream is cancelled at the deadline
        deadline = threading.Timer(self.upload_timeout_s, context.cancel)
        deadline.start()
        try:
            buffer = self._receive(chunks, nbytes, context)
            if not deadline.is_alive():
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "upload too slow: cut off")
            try:
                self.store.accept_upload(token, sha, buffer)
            except StoreError as err:
                context.abort(grpc.StatusCode.DATA_LOSS, str(err))
        finally:
            deadline.cancel()
            self.store.end_upload(token)
            self._upload_slots.release()
        return b"ok"

    @staticmethod
    def _receive(chunks: Iterator[bytes], nbytes: int, context: grpc.ServicerContext) -> bytearray:
        """Exactly the `nbytes` declared, or the stream is aborted."""
        buffer = bytearray(nbytes)
        view, received = memoryview(buffer), 0
        for chunk in chunks:
            if received + len(chunk) > nbytes:
                log.warning("upload cut off: more than the %d B declared", nbytes)
                context.abort(grpc.StatusCode.OUT_OF_RANGE, "more bytes than declared: cut off")
            view[received : received + len(chunk)] = chunk
            received += len(chunk)
        if received != nbytes:
            context.abort(grpc.StatusCode.DATA_LOSS, f"{received} of {nbytes} declared bytes")
        return buffer

    # ----- NIXL control calls (JSON in, JSON out) ---------------------------------------
    def _json(
        self, method: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                body = json.loads(request)
                if not isinstance(body, dict):
                    raise ValueError("not a JSON object")
                return json.dumps(method(body)).encode()
            except StoreError as err:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
            except (ValueError, TypeError, KeyError) as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {err}")
            raise AssertionError("unreachable: abort raises")

        return handle

    def _describe(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.agent is not None
        sha = str(body["sha256"])
        blob = self.store.blob(str(body["token"]), sha)
        with self._lock:
            for old in [s for s in self._published if not self.store.holds(s)]:
                self.agent.deregister(self._published.pop(old))
            self._published[sha] = blob
            return self.agent.register(blob).to_json()

    def _reserve(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.agent is not None
        token, sha, nbytes = str(body["token"]), str(body["sha256"]), int(body["nbytes"])
        self.store.check_upload(token, nbytes)
        buffer = bytearray(nbytes)  # a WRITE past its end is refused by the registration
        with self._lock:
            old = self._reserved.pop(token, None)
            if old is not None:
                self.agent.deregister(old[1])
            self._reserved[token] = (sha, buffer)
            return self.agent.register(buffer).to_json()

    def _commit(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.agent is not None
        token = str(body["token"])
        with self._lock:
            if token not in self._reserved:
                raise StoreError("nothing reserved for this token")
            sha, buffer = self._reserved.pop(token)
            self.agent.deregister(buffer)
        self.store.accept_upload(token, sha, buffer)
        return {"ok": True}

    @staticmethod
    def _ids(request: bytes, context: grpc.ServicerContext) -> tuple[str, str]:
        try:
            body = json.loads(request)
            return str(body["token"]), str(body["sha256"])
        except (ValueError, TypeError, KeyError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request is not {token, sha256}")
        raise AssertionError("unreachable: abort raises")
