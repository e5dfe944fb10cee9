"""The gate's deadlines and shares: headers in time, bodies in time, a few connections a peer."""

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from fl.net.gate import GateConfig, guarded_protocol, make_app

CONFIG = GateConfig(
    "127.0.0.1:9",  # no SuperLink: these requests never get that far
    None,
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    max_connections_per_peer=3,
)


@contextlib.contextmanager
def serving_gate(config: GateConfig, **ssl: str) -> Iterator[int]:
    """The gate with `config` on a free loopback port (TLS with `ssl_certfile`/`ssl_keyfile`),
    in a thread, until the block ends: its port."""
    server = uvicorn.Server(
        uvicorn.Config(
            make_app(config),
            host="127.0.0.1",
            port=0,
            http=guarded_protocol(config),
            ws="none",
            log_config=None,
            lifespan="on",
            **ssl,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the gate did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def gate() -> Iterator[int]:
    with serving_gate(CONFIG) as port:
        yield port


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    return sock


def _closed(sock: socket.socket, within_s: float) -> bool:
    """Whether the gate closes `sock` within `within_s` (reading to the end)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _answer(sock: socket.socket, request: bytes) -> bytes:
    sock.sendall(request)
    return sock.recv(4096)


def test_unfinished_headers_are_closed_after_the_header_deadline(gate):
    with _connect(gate) as sock:
        sock.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\n")  # no blank line
        started = time.monotonic()
        assert _closed(sock, within_s=5)
        assert 0.4 < time.monotonic() - started < 4


def test_a_body_that_trickles_is_refused_after_the_body_deadline(gate):
    with _connect(gate) as sock:
        head = b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\nContent-Length: 100\r\n\r\n"
        answer = _answer(sock, head + b"x")
        assert answer.startswith(b"HTTP/1.1 408")


def test_a_kept_alive_connection_gets_the_header_deadline_again(gate):
    with _connect(gate) as sock:
        assert _answer(sock, b"GET /nope HTTP/1.1\r\nHost: gate\r\n\r\n").startswith(
            b"HTTP/1.1 404"
        )
        sock.sendall(b"GET /again HTTP/1.1\r\n")  # then nothing more
        assert _closed(sock, within_s=5)


def test_one_peer_holds_at_most_its_share_of_connections(gate):
    held = [_connect(gate) for _ in range(CONFIG.max_connections_per_peer)]
    try:
        time.sleep(0.1)
        with _connect(gate) as extra:
            assert _closed(extra, within_s=2)  # refused at once, not after the deadline
        with _connect(gate, source="127.0.0.2") as other:  # another address is served
            assert _answer(other, b"GET /nope HTTP/1.1\r\nHost: gate\r\n\r\n").startswith(
                b"HTTP/1.1 404"
            )
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    with _connect(gate) as again:  # the share comes back when they close
        assert _answer(again, b"GET /nope HTTP/1.1\r\nHost: gate\r\n\r\n").startswith(
            b"HTTP/1.1 404"
        )
