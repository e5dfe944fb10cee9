"""After a TLS burst from one address, a SuperNode sharing that address is served again
within the gate's header deadline (issue 36, class 5).

The cause found: with TLS, a connection the gate closes waits for the peer's TLS
close_notify (asyncio's ssl_shutdown_timeout, 30 s) before `connection_lost`, and the
address's connection share used to be released only there. A burst whose sockets never
answer kept the address over its share for 30 s, although every connection was closed.
"""

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_gate_limits import CONFIG, serving_gate

from fl.net.tls import write_bundle

BURST = 40  # connections from one address, each through a full TLS handshake


@pytest.fixture(scope="module")
def tls_gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    certs = write_bundle(tmp_path_factory.mktemp("certs"))
    tls = {"ssl_certfile": str(certs.server_cert), "ssl_keyfile": str(certs.server_key)}
    with serving_gate(CONFIG, **tls) as port:
        yield port, certs.ca_cert


def _tls(port: int, ca: Path) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(ca))
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def _health(port: int, ca: Path) -> bytes:
    """The first bytes of the gate's answer to a health check, b"" if it closed instead."""
    try:
        with _tls(port, ca) as sock:
            sock.sendall(b"GET /nope HTTP/1.1\r\nHost: gate\r\n\r\n")
            return sock.recv(4096)
    except (ssl.SSLError, OSError):
        return b""


def test_a_tls_burst_does_not_lock_its_address_out_past_the_header_deadline(tls_gate):
    port, ca = tls_gate
    assert _health(port, ca).startswith(b"HTTP/1.1 404")
    burst: list[ssl.SSLSocket] = []
    started = time.monotonic()
    try:
        for _ in range(BURST):  # handshakes done, then silence: never a request, never a read
            with contextlib.suppress(ssl.SSLError, OSError):  # refused at once: fine too
                burst.append(_tls(port, ca))
        assert time.monotonic() - started < 20, "the burst itself took too long"
        time.sleep(CONFIG.header_timeout_s + 0.5)  # every burst connection is now closed
        served_at = None
        deadline = time.monotonic() + 5
        while served_at is None and time.monotonic() < deadline:
            if _health(port, ca).startswith(b"HTTP/1.1 404"):
                served_at = time.monotonic()
            else:
                time.sleep(0.1)
        assert served_at is not None, "the address is still locked out after the deadline"
    finally:
        for sock in burst:  # the burst's sockets stay open (unread) until here
            sock.close()
