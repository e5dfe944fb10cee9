"""The control protocol between a ClientApp and its node's bulk agent (the sidecar).

One Unix `SOCK_SEQPACKET` connection per operation; each packet is one JSON object of at
most `MAX_PACKET` bytes, optionally with one file descriptor (SCM_RIGHTS): the shared
memory segment the bytes are in. The connection's lifetime is the segment's lease:
the sidecar reuses a segment only once its ClientApp has hung up.

    fetch:  -> {"op": "fetch", "offer": {...}, "sha256": HEX, "nbytes": N}
            <- {"ok": true, "nbytes": N} + a read-only fd (the blob, SHA-256 checked)
    upload: -> {"op": "lease", "nbytes": N}
            <- {"ok": true, "nbytes": N} + a writable fd (the ClientApp packs into it)
            -> {"op": "upload", "offer": {...}, "sha256": HEX}
            <- {"ok": true}
    ping:   -> {"op": "ping"}  <- {"ok": true, "pid": ..., "nixl": bool}

Any failure answers {"ok": false, "error": "..."}. Both sides treat what they receive
as untrusted: sizes, types and counts are checked here, the offer by `Offer.parse`.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

__all__ = ["MAX_PACKET", "ControlError", "peer_uid", "receive", "send"]

MAX_PACKET = 64 * 2**10  # an offer with its CA's PEM is about 2 KiB


class ControlError(RuntimeError):
    """A control packet that is malformed, too large, or an error answer."""


def send(sock: socket.socket, body: dict[str, Any], fd: int | None = None) -> None:
    data = json.dumps(body).encode()
    if len(data) > MAX_PACKET:
        raise ControlError(f"control packet of {len(data)} B is over {MAX_PACKET} B")
    if fd is None:
        sock.sendall(data)
    else:
        socket.send_fds(sock, [data], [fd])


def receive(sock: socket.socket, *, with_fd: bool = False) -> tuple[dict[str, Any], int | None]:
    """The next packet as a JSON object, and the descriptor that came with it (only when
    `with_fd`; any other is closed at once). An empty dict when the peer hung up."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_PACKET + 1, 1)
    fd = fds[0] if fds else None
    if fd is not None and not with_fd:
        os.close(fd)
        fd = None
    try:
        return _parse(data, flags), fd
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise


def _parse(data: bytes, flags: int) -> dict[str, Any]:
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_PACKET:
        raise ControlError(f"control packet over {MAX_PACKET} B (or over one descriptor)")
    if not data:
        return {}
    try:
        body = json.loads(data)
    except ValueError as err:
        raise ControlError(f"control packet is not JSON: {err}") from err
    if not isinstance(body, dict):
        raise ControlError("control packet is not a JSON object")
    return body


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])
