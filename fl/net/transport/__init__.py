"""The bulk tensor side channel: large arrays beside Flower's messages, not inside them.

Flower carries control messages (and, by default, the arrays too). With `transport=grpc`
or `transport=rdma`, a Grid wrapper on the ServerApp (`BulkGrid`) and a ClientApp mod
(`bulk_mod`) swap each large ArrayRecord for a small reference record (peer, shapes,
dtypes, SHA-256); the bytes move over a grpcio stream or a NIXL one-sided transfer, and
any failure falls back to the inline message, counted in the run's metrics. On deployed
nodes a long-lived bulk agent (`python -m fl.net.transport.sidecar`) does the node's transfers
for every ClientApp process. docs/TRANSPORT.md says which library does what.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flwr.serverapp import Grid
from omegaconf import DictConfig

from fl.common.config import check_choice, check_int, check_number, require
from fl.net.transport.grid import BulkGrid, TransportSettings
from fl.net.transport.mod import bulk_mod
from fl.net.transport.nixl_link import TransportUnavailable, nixl_available

__all__ = [
    "TRANSPORTS",
    "BulkGrid",
    "TransportSettings",
    "TransportUnavailable",
    "bulk_mod",
    "check_transport",
    "nixl_available",
    "transport_grid",
]

TRANSPORTS = ("inline", "grpc", "rdma")  # conf/transport/NAME.yaml


@contextmanager
def transport_grid(grid: Grid, cfg: Any, max_reply_bytes: int | None = None) -> Iterator[Grid]:
    """`grid` itself for `transport=inline`, else wrapped in a `BulkGrid` whose bulk
    service stops on exit. `max_reply_bytes`: the largest reply the run accepts at all (the
    server half's bound), which caps an upload below `transport.max_upload_bytes`."""
    settings = TransportSettings.from_config(cfg)
    if max_reply_bytes is not None and max_reply_bytes < settings.max_upload_bytes:
        settings = dataclasses.replace(settings, max_upload_bytes=max_reply_bytes)
    if settings.name == "inline":
        yield grid
        return
    bulk = BulkGrid(grid, settings)
    try:
        yield bulk
    finally:
        bulk.close()


def check_transport(cfg: DictConfig) -> None:
    """The side channel (conf/transport/*.yaml): its name, TLS mode, addresses and limits,
    and for rdma that NIXL imports here, before any round."""
    check_choice(cfg, "transport.name", TRANSPORTS)
    if cfg.transport.name == "inline":
        return
    tls = cfg.transport.get("tls")
    require(
        tls == "auto" or isinstance(tls, bool), "transport.tls", tls, "must be auto, true or false"
    )
    listen, advertise = cfg.transport.get("listen"), cfg.transport.get("advertise")
    require(_is_address(listen), "transport.listen", listen, "must be HOST:PORT (port 0-65535)")
    require(
        advertise is None or _is_address(advertise),
        "transport.advertise",
        advertise,
        "must be null or HOST:PORT",
    )
    check_int(cfg, "transport.min_bytes", 0)
    check_int(cfg, "transport.chunk_bytes", 1)
    check_int(cfg, "transport.max_upload_bytes", 1)
    check_number(cfg, "transport.timeout_s", 0, strict=True)
    check_number(cfg, "transport.ttl_s", 0, strict=True)
    if cfg.transport.name == "rdma":
        missing = nixl_available()
        require(
            missing is None,
            "transport.name",
            "rdma",
            f"needs NIXL (pip install -e '.[rdma]'), which does not import here: {missing}",
        )


def _is_address(value: Any) -> bool:
    """HOST:PORT with a non-empty host and a port in 0-65535 (IPv6 hosts in brackets)."""
    if not isinstance(value, str) or ":" not in value:
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and int(port) <= 65535
