"""How a ClientApp moves its bytes: by itself, or through its node's bulk agent.

`node_link(context)` picks the way from the node config: with `bulk-agent=PATH`
(`flower-supernode --node-config`), a `SidecarLink` asks the sidecar at PATH
(`fl.net.transport.sidecar`) and maps the shared memory it answers with; without it, a
`ProcessLink` dials the server from this process (and, for rdma, makes its own NIXL
agent). Both give `bulk_mod` the same two operations:

- `fetch(offer, reference)`: a context manager yielding the blob, its SHA-256 checked;
  the blob's memory is valid inside the `with` only;
- `upload(offer)`: a context manager yielding an `Outgoing`, whose `allocate(nbytes)`
  gives the memory to pack the reply's blob into and `send(reference, blob)` uploads it.
"""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any, Protocol

from flwr.app import Context

from fl.common.text import shown
from fl.net.transport.control import ControlError, peer_uid, receive, send
from fl.net.transport.nixl_link import Buffer
from fl.net.transport.offer import Offer
from fl.net.transport.peer import fetch, upload
from fl.net.transport.reference import Reference
from fl.net.transport.segments import map_segment

__all__ = ["NODE_CONFIG_KEY", "Link", "Outgoing", "ProcessLink", "SidecarLink", "node_link"]

NODE_CONFIG_KEY = "bulk-agent"  # flower-supernode --node-config "bulk-agent=PATH"
CONNECT_S = 5.0  # a live sidecar accepts at once


class Outgoing(Protocol):
    def allocate(self, nbytes: int) -> Buffer: ...

    def send(self, reference: Reference, blob: Buffer) -> None: ...


class Link(Protocol):
    def fetch(
        self, offer: Offer, reference: Reference
    ) -> AbstractContextManager[bytearray | memoryview]: ...

    def upload(self, offer: Offer) -> AbstractContextManager[Outgoing]: ...


def node_link(context: Context) -> Link:
    """The node's sidecar when its node config names one, else this process."""
    path = context.node_config.get(NODE_CONFIG_KEY)
    return SidecarLink(path) if isinstance(path, str) and path else ProcessLink()


# ----- by itself -------------------------------------------------------------------------


class ProcessLink:
    """The bytes move from and to this process (a fresh ClientApp process per message)."""

    @contextmanager
    def fetch(self, offer: Offer, reference: Reference) -> Iterator[bytearray | memoryview]:
        blob = bytearray(reference.nbytes)
        fetch(offer, reference, into=blob)  # its SHA-256 checked
        yield blob

    @contextmanager
    def upload(self, offer: Offer) -> Iterator[Outgoing]:
        yield _ProcessOutgoing(offer)


class _ProcessOutgoing:
    def __init__(self, offer: Offer) -> None:
        self.offer = offer

    def allocate(self, nbytes: int) -> Buffer:
        return bytearray(nbytes)

    def send(self, reference: Reference, blob: Buffer) -> None:
        upload(self.offer, reference, blob)


# ----- through the node's sidecar --------------------------------------------------------


class SidecarLink:
    """The node's bulk agent moves the bytes; they reach this process as shared memory."""

    def __init__(self, path: str) -> None:
        self.path = path

    def connect(self, timeout_s: float) -> socket.socket:
        """A connection to the agent (of this user), for one request."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(CONNECT_S)
            sock.connect(self.path)
            if peer_uid(sock) != os.getuid():
                raise ControlError(f"the bulk agent at {self.path} runs as another user")
            sock.settimeout(timeout_s)
        except BaseException:
            sock.close()
            raise
        return sock

    @contextmanager
    def fetch(self, offer: Offer, reference: Reference) -> Iterator[bytearray | memoryview]:
        with self.connect(offer.timeout_s + CONNECT_S) as sock:
            request = {"op": "fetch", "offer": _offer(offer), "sha256": reference.sha256}
            send(sock, {**request, "nbytes": reference.nbytes})
            fd = _answer(sock, reference.nbytes)
            with _mapped(map_segment(fd, reference.nbytes, writable=False)) as blob:
                yield blob

    @contextmanager
    def upload(self, offer: Offer) -> Iterator[Outgoing]:
        outgoing = _SidecarOutgoing(self, offer)  # (connects once there is a blob)
        try:
            yield outgoing
        finally:
            outgoing.close()

    def ping(self) -> dict[str, Any]:
        """The agent's answer to a ping (`pid`, `nixl`)."""
        with self.connect(CONNECT_S) as sock:
            send(sock, {"op": "ping"})
            answer, _ = receive(sock)
            if answer.get("ok") is not True:
                raise ControlError(f"the bulk agent answered {answer!r}")
            return answer


class _SidecarOutgoing:
    def __init__(self, link: SidecarLink, offer: Offer) -> None:
        self.link, self.offer = link, offer
        self.sock: socket.socket | None = None
        self.memory: mmap.mmap | None = None
        self.views: list[memoryview] = []

    def allocate(self, nbytes: int) -> Buffer:
        if self.sock is not None:
            raise ControlError("one blob per upload")
        self.sock = self.link.connect(self.offer.timeout_s + CONNECT_S)
        send(self.sock, {"op": "lease", "nbytes": nbytes})
        self.memory = map_segment(_answer(self.sock, nbytes), nbytes, writable=True)
        self.views.append(memoryview(self.memory))
        return self.views[-1]

    def send(self, reference: Reference, blob: Buffer) -> None:
        if self.sock is None or self.memory is None or len(blob) != len(self.memory):
            raise ControlError("upload a blob from this upload's own memory")
        body = {"op": "upload", "offer": _offer(self.offer), "sha256": reference.sha256}
        send(self.sock, body)
        answer, _ = receive(self.sock)
        if answer.get("ok") is not True:
            raise ControlError(f"the bulk agent could not upload: {answer.get('error', answer)}")

    def close(self) -> None:
        for view in self.views:
            _release(view)
        if self.memory is not None:
            _close(self.memory)
        if self.sock is not None:
            self.sock.close()


def _offer(offer: Offer) -> dict[str, Any]:
    return dict(offer.to_record())


def _answer(sock: socket.socket, nbytes: int) -> int:
    """The segment's descriptor from an `ok` answer for `nbytes`, else ControlError."""
    answer, fd = receive(sock, with_fd=True)
    if answer.get("ok") is True and answer.get("nbytes") == nbytes and fd is not None:
        return fd
    if fd is not None:
        os.close(fd)
    reason = answer.get("error", answer) if answer else "it hung up"
    raise ControlError(f"the bulk agent refused: {shown(reason)}")


@contextmanager
def _mapped(memory: mmap.mmap) -> Iterator[memoryview]:
    view = memoryview(memory)
    try:
        yield view
    finally:
        _release(view)
        _close(memory)


def _release(view: memoryview) -> None:
    with suppress(BufferError):  # an array still looks into it: the mapping goes with it
        view.release()


def _close(memory: mmap.mmap) -> None:
    with suppress(BufferError):  # (as above)
        memory.close()
