"""A Fleet-only front for a SuperLink: SuperNodes get through, Control and Runtime calls do not.

flwr 1.42 serves the Fleet API (SuperNodes), the Control API (`flwr run`, `flwr ls`,
`flwr supernode register`) and the Runtime API (its own ServerApp processes) over HTTP on
one port, told apart only by path (`/v1/fleet/…`, `/v1/control/…`, `/v1/runtime/…`). The
open-source build authenticates no Control call (its one Control authentication plugin is
a no-op; OIDC needs Flower Enterprise) and, with the default subprocess isolation, no
Runtime `acquire-task` either. So whoever can open a TLS connection to that port, which
only needs `ca.pem`, can register a key of their own and join the next run.

The remedy: bind the SuperLink to 127.0.0.1 and put this gate on the public address. It
forwards `POST /v1/fleet/<method>` and `GET /health` to the SuperLink unchanged (headers
included, so SuperNode authentication works through it) and answers 404 to every other
request, logging it. The Control API is then reachable only from the SuperLink's machine
(operators elsewhere use an SSH port forward):

    flower-superlink --host 127.0.0.1 --port 8001 --enable-supernode-auth \\
        --ssl-certfile server.pem --ssl-keyfile server.key --ssl-ca-certfile ca.pem
    python -m fl.net.gate --listen 0.0.0.0:8000 --superlink 127.0.0.1:8001 \\
        --ssl-certfile server.pem --ssl-keyfile server.key --ssl-ca-certfile ca.pem

Every wait has a deadline and every peer a share: a request's headers must arrive within
`header_timeout_s` of the connection (or of the previous response), its body within
`body_timeout_s`, and one address holds at most `max_connections_per_peer` open
connections, so idle or trickling connections from one outsider cannot lock SuperNodes
out, nor lock out a SuperNode behind the same address for longer than `header_timeout_s`
after the outsider stops (a closed connection no longer counts, TLS or not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "MAX_BODY_BYTES",
    "GateConfig",
    "guarded_protocol",
    "is_forwarded",
    "main",
    "make_app",
]

log = logging.getLogger("fl.net.gate")

# The method names of flwr's Fleet routes (`/v1/fleet/pull-messages`, …): letters and
# dashes only, so no dot segment, query or percent-escape can turn one into another API's.
FLEET_PATH = re.compile(rb"/v1/fleet/[a-z]+(?:-[a-z]+)*")
MAX_BODY_BYTES = 64 * 2**20  # Flower splits arrays into 5 MiB objects; requests stay small
# Connection-level headers (RFC 9110 §7.6.1) and those httpx recomputes.
DROPPED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
    }
)


def is_forwarded(method: str, raw_path: bytes, query: bytes = b"") -> bool:
    """Whether the gate passes this request on: a Fleet call, or the health check."""
    if query:
        return False
    if method == "GET":
        return raw_path == b"/health"
    return method == "POST" and FLEET_PATH.fullmatch(raw_path) is not None


@dataclass(frozen=True)
class GateConfig:
    """Where the SuperLink listens and how to trust it."""

    superlink: str  # host:port, normally 127.0.0.1:PORT
    root_certificates: str | None  # ca.pem; None: plain HTTP (an --insecure SuperLink)
    max_body_bytes: int = MAX_BODY_BYTES
    timeout_s: float = 300.0  # the SuperLink's answer (a pull may wait for messages)
    header_timeout_s: float = 10.0  # a request's headers, from connect or the last response
    body_timeout_s: float = 60.0  # its body, MAX_BODY_BYTES at ~1 MB/s
    max_connections_per_peer: int = 64  # open connections from one address


def _headers(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {k: v for k, v in items if k.lower() not in DROPPED}


async def _body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it exceeds `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def make_app(config: GateConfig) -> Starlette:
    """The gate as an ASGI app forwarding to `config.superlink`."""
    scheme = "http" if config.root_certificates is None else "https"
    verify: ssl.SSLContext | bool = False
    if config.root_certificates is not None:
        verify = ssl.create_default_context(cafile=config.root_certificates)
    state: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with httpx.AsyncClient(
            base_url=f"{scheme}://{config.superlink}",
            verify=verify,
            timeout=config.timeout_s,
            trust_env=False,  # straight to the SuperLink, never through an HTTP(S)_PROXY
        ) as client:
            state["client"] = client
            yield

    async def forward(request: Request) -> Response:
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string", b"")
        peer = request.client.host if request.client else "?"
        if not is_forwarded(request.method, raw_path, query):
            log.warning("refused %s %r from %s", request.method, raw_path.decode("latin-1"), peer)
            return Response(status_code=404)
        try:
            body = await asyncio.wait_for(
                _body(request, config.max_body_bytes), config.body_timeout_s
            )
        except ClientDisconnect:
            return Response(status_code=400)
        except TimeoutError:
            log.warning(
                "refused %r from %s: body not sent within %gs",
                raw_path,
                peer,
                config.body_timeout_s,
            )
            return Response(status_code=408)
        if body is None:
            log.warning(
                "refused %r from %s: body over %d bytes", raw_path, peer, config.max_body_bytes
            )
            return Response(status_code=413)
        try:
            upstream = await state["client"].request(
                request.method,
                raw_path.decode("ascii"),
                content=body,
                headers=_headers(request.headers.items()),
            )
        except httpx.HTTPError as err:
            log.error("SuperLink unreachable for %s: %s", raw_path, err)
            return Response(status_code=502)
        return Response(upstream.content, upstream.status_code, _headers(upstream.headers.items()))

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def guarded_protocol(config: GateConfig) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `config`'s header deadline and per-peer connection cap.

    A connection holds its address's share from the moment it is handed to the protocol
    (after the TLS handshake) until the gate closes it, not until it is gone: with TLS a
    closed connection waits for the peer's close_notify (asyncio's ssl_shutdown_timeout,
    30 s) before `connection_lost`, and a burst whose sockets never answer used to keep
    its address over the share that long. Connections the gate refuses or finds idle are
    aborted, with no close_notify to wait for.
    """
    open_by_peer: Counter[str] = Counter()

    class Guarded(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _peer = ""
        _counted = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._peer = self.client[0] if self.client else "?"
            open_by_peer[self._peer] += 1
            self._counted = True
            if open_by_peer[self._peer] > config.max_connections_per_peer:
                log.warning(
                    "refused a connection from %s: over %d open",
                    self._peer,
                    config.max_connections_per_peer,
                )
                self._release()
                transport.abort()
                return
            self._arm()

        def _release(self) -> None:
            """Give the connection's share of its address back (once)."""
            if self._counted:
                self._counted = False
                open_by_peer[self._peer] -= 1
                if open_by_peer[self._peer] <= 0:
                    del open_by_peer[self._peer]

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(config.header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_late(self) -> None:
            if self.cycle is None or self.cycle.response_complete:  # no request under way
                log.warning(
                    "closed a connection from %s: no request within %gs",
                    self._peer,
                    config.header_timeout_s,
                )
                self._release()
                self.transport.abort()

        def _release_if_closing(self) -> None:
            """After each place uvicorn may close the connection (a bad request, the end
            of a response without keep-alive, its keep-alive timeout, shutdown)."""
            if self.transport.is_closing():
                self._release()

        def handle_events(self) -> None:
            super().handle_events()
            self._release_if_closing()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request's headers are in: the body has its own deadline

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._release_if_closing()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers

        def timeout_keep_alive_handler(self) -> None:
            super().timeout_keep_alive_handler()
            self._release_if_closing()

        def shutdown(self) -> None:
            super().shutdown()
            self._release_if_closing()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._release()
            super().connection_lost(exc)

    return Guarded


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _address(address: str) -> str:
    _host_port(address)
    return address


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: `python -m fl.net.gate --listen HOST:PORT --superlink 127.0.0.1:PORT …`."""
    parser = argparse.ArgumentParser(
        prog="python -m fl.net.gate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--listen", required=True, type=_host_port, help="public HOST:PORT SuperNodes dial"
    )
    parser.add_argument(
        "--superlink", required=True, type=_address, help="the SuperLink's 127.0.0.1:PORT"
    )
    parser.add_argument("--ssl-certfile", help="server certificate (the SuperLink's)")
    parser.add_argument("--ssl-keyfile", help="its key")
    parser.add_argument("--ssl-ca-certfile", help="the CA that signed the SuperLink's certificate")
    parser.add_argument(
        "--insecure", action="store_true", help="plain HTTP on both sides (trusted networks only)"
    )
    parser.add_argument("--max-body-mib", type=int, default=MAX_BODY_BYTES >> 20)
    parser.add_argument("--header-timeout-s", type=float, default=GateConfig.header_timeout_s)
    parser.add_argument("--body-timeout-s", type=float, default=GateConfig.body_timeout_s)
    parser.add_argument(
        "--max-connections-per-peer", type=int, default=GateConfig.max_connections_per_peer
    )
    args = parser.parse_args(argv)
    tls = (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certfile)
    if args.insecure == any(tls) or not (args.insecure or all(tls)):
        parser.error("give --ssl-certfile, --ssl-keyfile and --ssl-ca-certfile, or --insecure")
    host, port = args.listen
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded call
    config = GateConfig(
        args.superlink,
        args.ssl_ca_certfile,
        args.max_body_mib << 20,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_connections_per_peer=args.max_connections_per_peer,
    )
    log.info(
        "Fleet gate on %s:%d -> %s (Control and Runtime API refused)", host, port, config.superlink
    )
    uvicorn.run(
        make_app(config),
        host=host,
        port=port,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        http=guarded_protocol(config),
        ws="none",  # the Fleet API is plain HTTP
        access_log=False,
        log_config=None,  # uvicorn's lines go through the root handler set up above
    )


if __name__ == "__main__":
    main()
