"""A node's long-lived bulk agent ("sidecar"): one NIXL agent and kept gRPC channels.

A deployed SuperNode starts a fresh ClientApp process for every message, so a ClientApp
that moved its own bytes would import NIXL, create an agent and connect it every time
(about 0.7 s on a 2-core host). Started once beside `flower-supernode`, the sidecar does
the transfers for every ClientApp of its node:

    python -m fl.net.transport.sidecar --socket /run/fl-bulk.sock &
    flower-supernode ... --node-config '... bulk-agent="/run/fl-bulk.sock"'  # TOML: quoted

`bulk_mod` finds it through the node config key `bulk-agent` and asks it, over the Unix
socket (`fl.net.transport.control`), to fetch a blob or upload one. The bytes sit in shared
memory segments (`fl.net.transport.segments`) that the sidecar registers with NIXL once and
maps into the ClientApp by passing their file descriptors; the one-sided READ or WRITE
lands directly in them, and the ClientApp never imports NIXL. The sidecar checks each
fetched blob's SHA-256 before handing it over.

Everything it receives is untrusted: only processes of its own user may connect; packets,
sizes and offers are checked before any allocation; a segment a ClientApp could write to
is never lent for a download (two pools); segments and the socket file are cleaned up on
errors and on exit (the segments are anonymous memory files, freed by the kernel even if
the sidecar is killed). A ClientApp that cannot reach its sidecar falls back to inline
Flower messages, counted like every other fallback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import stat
import threading
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord

from fl.net.transport.control import ControlError, peer_uid, receive, send
from fl.net.transport.nixl_link import agent, nixl_available
from fl.net.transport.offer import Offer
from fl.net.transport.peer import Channels, fetch, upload
from fl.net.transport.reference import blob_sha256, blob_size
from fl.net.transport.segments import Segment, SegmentPool

__all__ = ["Sidecar", "main"]

log = logging.getLogger(__name__)
ERROR_CHARS = 500


@dataclass(frozen=True)
class _Blob:
    sha256: str
    nbytes: int


class Sidecar:
    """The agent's server: `serve_forever()` until `stop()`; `close()` frees everything.

    `max_bytes`: the most shared memory per direction (downloads, uploads), segments in
    use and kept for reuse together; a larger request is refused (and goes inline).
    `lease_s`: how long a ClientApp may hold a segment or take to send a request.
    `nixl`: make the NIXL agent at start (else `transport=rdma` requests are refused).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 4 * 2**30,
        lease_s: float = 300.0,
        max_connections: int = 32,
        nixl: bool = True,
    ) -> None:
        self.path = Path(path)
        self.lease_s = lease_s
        self.nixl = nixl and nixl_available() is None
        if self.nixl:
            agent()  # now, not on the first transfer
        self.channels = Channels(keep=True)
        self.down = SegmentPool(max_bytes, on_close=self._deregister, peer_writes=False)
        self.up = SegmentPool(max_bytes, on_close=self._deregister)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopping = threading.Event()
        self._socket = _listen(self.path)

    # ----- lifecycle ---------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Accept ClientApps, one thread each, until `stop()`."""
        self._socket.settimeout(0.2)
        while not self._stopping.is_set():
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    break
                raise
            if not self._slots.acquire(blocking=False):
                _answer_error(conn, "the bulk agent is busy")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        """Stop listening, remove the socket file, free every segment and channel."""
        self.stop()
        self._socket.close()
        self.path.unlink(missing_ok=True)
        self.down.close()
        self.up.close()
        self.channels.close()

    # ----- one ClientApp's request -------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                try:
                    self._handle(conn)
                except Exception as err:  # a failed request ends its connection only
                    log.warning("bulk agent request failed: %s", _reason(err))
                    _answer_error(conn, _reason(err))
        finally:
            self._slots.release()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(self.lease_s)
        if peer_uid(conn) != os.getuid():
            raise ControlError("the peer runs as another user")
        request, _ = receive(conn)
        op = request.get("op")
        if op == "fetch":
            self._fetch(conn, request)
        elif op == "lease":
            self._lease_and_upload(conn, request)
        elif op == "ping":
            send(conn, {"ok": True, "pid": os.getpid(), "nixl": self.nixl})
        elif request:
            raise ControlError(f"unknown op {str(op)[:40]!r}")

    def _fetch(self, conn: socket.socket, request: dict[str, Any]) -> None:
        offer, blob = self._offer(request), self._blob(request)
        segment = self.down.lease(blob.nbytes)
        try:
            if offer.kind == "rdma":
                self._register(segment)
            with segment.view(blob.nbytes) as view:
                fetch(offer, blob, into=view, channels=self.channels)  # SHA-256 checked
            readonly = os.open(f"/proc/self/fd/{segment.fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                send(conn, {"ok": True, "nbytes": blob.nbytes}, readonly)
            finally:
                os.close(readonly)
            receive(conn)  # the ClientApp hangs up (or says anything) when it is done
        finally:
            self.down.give_back(segment)

    def _lease_and_upload(self, conn: socket.socket, request: dict[str, Any]) -> None:
        nbytes = blob_size(request.get("nbytes"))
        segment = self.up.lease(nbytes)
        try:
            send(conn, {"ok": True, "nbytes": nbytes}, segment.fd)
            request, _ = receive(conn)
            if not request:
                return  # (the ClientApp gave up before uploading)
            if request.get("op") != "upload":
                raise ControlError("a lease is followed by an upload")
            offer, blob = self._offer(request), self._blob({**request, "nbytes": nbytes})
            if offer.kind == "rdma":
                self._register(segment)
            with segment.view(nbytes) as view:
                upload(offer, blob, view, channels=self.channels)
            send(conn, {"ok": True})
        finally:
            self.up.give_back(segment)

    # ----- checks and NIXL ---------------------------------------------------------------
    def _offer(self, request: dict[str, Any]) -> Offer:
        record = request.get("offer")
        if not isinstance(record, dict):
            raise ControlError("the request has no offer")
        try:
            offer = Offer.parse(ConfigRecord(record))
        except (TypeError, ValueError) as err:
            raise ControlError(f"bad offer: {err}") from err
        if offer.kind == "rdma" and not self.nixl:
            raise ControlError(f"this bulk agent has no NIXL: {nixl_available() or 'off'}")
        return offer

    @staticmethod
    def _blob(request: dict[str, Any]) -> _Blob:
        return _Blob(blob_sha256(request.get("sha256")), blob_size(request.get("nbytes")))

    def _register(self, segment: Segment) -> None:
        if not segment.registered:
            agent().register(segment.memory)
            segment.registered = True

    def _deregister(self, segment: Segment) -> None:
        if segment.registered:
            agent().deregister(segment.memory)


def _reason(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:ERROR_CHARS]


def _answer_error(conn: socket.socket, reason: str) -> None:
    with suppress(OSError):  # (the ClientApp may be gone)
        send(conn, {"ok": False, "error": reason})


def _listen(path: Path) -> socket.socket:
    """A Unix seqpacket socket at `path`, readable by this user only. A stale socket file
    (nobody listening) is replaced; a live one is an error."""
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: its sidecar is gone
        else:
            raise FileExistsError(f"a bulk agent already listens on {path}")
        finally:
            probe.close()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    server.listen(64)
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, help="the Unix socket path (node config)")
    parser.add_argument("--max-gib", type=float, default=4.0, help="shared memory per direction")
    parser.add_argument("--lease-s", type=float, default=300.0)
    parser.add_argument("--no-nixl", action="store_true", help="serve transport=grpc only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bulk-agent %(message)s")
    sidecar = Sidecar(
        args.socket,
        max_bytes=int(args.max_gib * 2**30),
        lease_s=args.lease_s,
        nixl=not args.no_nixl,
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sidecar.stop())
    log.info("listening on %s (NIXL: %s)", args.socket, "yes" if sidecar.nixl else "no")
    try:
        sidecar.serve_forever()
    finally:
        sidecar.close()
        log.info("stopped")
    if sidecar.nixl:  # NIXL 1.5.1 can crash in its exit handlers (docs/TRANSPORT.md)
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
