"""The Flower ServerApp: reads the run's config, waits for its nodes, drives the round loop.

Loaded by module path (`server.app:app`) in a deployment, called directly by the
local engine, and run in a thread by Flower's simulation.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fl.common.config import from_run_config
from fl.common.seeding import pin_torch_threads
from fl.net.transport import transport_grid
from fl.run.validation import validate
from fl.strategy.server import reply_limit
from fl.world.task import get_task
from server.loop import run_training
from server.nodes import AllowedGrid, allowed_nodes, node_wait_s, wait_for_nodes

__all__ = ["app"]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train for the configured rounds; outputs go to `output_dir` (or outputs/run-ID).

    Raises (so Flower marks the run `finished:failed`) before any data is loaded or
    output written when fewer than `num_clients` allowed nodes connect (server/nodes.py).
    With `engine.allowed_nodes`, nodes off that list are refused for the whole run.
    """
    cfg = from_run_config(context.run_config)
    validate(cfg)
    pin_torch_threads(cfg.torch_threads)
    allowed = allowed_nodes(cfg)
    if allowed is not None:
        grid = AllowedGrid(grid, allowed)
    wait_for_nodes(grid, cfg.num_clients, node_wait_s(cfg))
    out_dir = Path(cfg.get("output_dir") or f"outputs/run-{context.run_id}")
    limit = reply_limit(get_task(cfg).layout)  # the task is cached: run_training reuses it
    with transport_grid(grid, cfg, limit) as bulk:  # transport=grpc|rdma: arrays beside messages
        run_training(bulk, cfg, out_dir)
