"""The bulk tensor side channel: large arrays beside Flower's messages, not inside them.

Flower carries control messages (and, by default, the arrays too). With `transport=grpc`
or `transport=rdma`, a Grid wrapper on the ServerApp (`BulkGrid`) and a ClientApp mod
(`bulk_mod`) swap each large ArrayRecord for a small reference record (peer, shapes,
dtypes, SHA-256); the bytes move over a grpcio stream or a NIXL one-sided transfer, and
any failure falls back to the inline message, counted in the run's metrics. On deployed
nodes a long-lived bulk agent (`python -m fl.transport.sidecar`) does the node's transfers
for every ClientApp process. docs/TRANSPORT.md says which library does what.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flwr.serverapp import Grid

from fl.transport.grid import BulkGrid, TransportSettings
from fl.transport.mod import bulk_mod
from fl.transport.nixl_link import TransportUnavailable, nixl_available

__all__ = [
    "BulkGrid",
    "TransportSettings",
    "TransportUnavailable",
    "bulk_mod",
    "nixl_available",
    "transport_grid",
]


@contextmanager
def transport_grid(grid: Grid, cfg: Any) -> Iterator[Grid]:
    """`grid` itself for `transport=inline`, else wrapped in a `BulkGrid` whose bulk
    service stops on exit."""
    settings = TransportSettings.from_config(cfg)
    if settings.name == "inline":
        yield grid
        return
    bulk = BulkGrid(grid, settings)
    try:
        yield bulk
    finally:
        bulk.close()
