"""The synchronous round loop: select, send, aggregate, evaluate, clock, log, checkpoint.

Written once for every strategy and engine. The strategy decides who trains and what
each node receives and how replies are combined; this loop counts the bytes each
message puts on the link, advances the virtual clock, and makes the run resumable.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from omegaconf import DictConfig
from tqdm import tqdm

from fl.clock import ClientWork, VirtualClock, build_profiles
from fl.codec import Traffic, payload_traffic
from fl.config import plain
from fl.registry import get_strategy
from fl.strategy import ServerStrategy
from fl.task import get_task
from fl.tracking import RunLog
from server.checkpoint import load_checkpoint, restore_rng, rng_state, save_checkpoint
from server.evaluation import evaluate_global

__all__ = ["Progress", "discover_partitions", "make_strategy", "run_training"]

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.pt"


@dataclass
class Progress:
    """Counters that continue across a resume."""

    round: int = 0
    virtual_time_s: float = 0.0
    wall_time_s: float = 0.0
    cum_bytes_up: int = 0
    cum_bytes_down: int = 0
    cum_payload_bytes_up: int = 0
    cum_payload_bytes_down: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def discover_partitions(grid: Grid, expected: int, timeout_s: float = 300.0) -> dict[int, int]:
    """Map node id -> partition id by asking every node (waits for `expected` nodes)."""
    deadline = time.monotonic() + timeout_s
    while len(nodes := sorted(grid.get_node_ids())) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(nodes)} of {expected} nodes connected after {timeout_s} s"
            )
        time.sleep(0.5)
    queries = [Message(RecordDict(), node, MessageType.QUERY + ".info") for node in nodes]
    replies = list(grid.send_and_receive(queries, timeout=timeout_s))
    found = {
        r.metadata.src_node_id: cast(int, r.content.config_records["info"]["partition-id"])
        for r in replies
        if r.has_content()
    }
    if len(found) < expected:
        raise RuntimeError(f"{len(found)} of {expected} nodes answered the partition query")
    return found


def make_strategy(cfg: DictConfig) -> ServerStrategy:
    """The configured strategy's server half."""
    values = plain(cfg.strategy)
    spec = get_strategy(str(values["name"]))
    return spec.server(
        spec.make_params(values),
        seed=cfg.seed,
        clients_per_round=cfg.clients_per_round,
        max_update_norm=float(cfg.max_update_norm),
    )


def _print_row(bar: tqdm, row: dict[str, Any], first: bool) -> None:
    cols = ("round", "accuracy", "loss", "bytes_up", "bytes_down", "virtual_time_s")
    if first:
        bar.write("  ".join(f"{c:>14}" for c in cols))
    cells = [f"{row[c]:>14.4f}" if isinstance(row[c], float) else f"{row[c]:>14}" for c in cols]
    bar.write("  ".join(cells))


def run_training(grid: Grid, cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run (or resume) `cfg.rounds` rounds on `grid`; write outputs to `out_dir`."""
    task = get_task(cfg)
    strategy = make_strategy(cfg)
    partitions = discover_partitions(grid, cfg.num_clients)
    profiles = build_profiles(cfg.num_clients, seed=cfg.seed, **_system_options(cfg))
    clock = VirtualClock(profiles, cfg.seed)
    strategy.reachable = lambda rnd, nodes: _reachable(clock, partitions, rnd, nodes)

    checkpoint_path = out_dir / CHECKPOINT
    progress, arrays = Progress(), ArrayRecord(task.new_model().state_dict())
    if cfg.resume:
        saved = load_checkpoint(checkpoint_path)
        progress, arrays = saved["progress"], ArrayRecord(saved["arrays"])
        strategy.load_state_dict(saved["strategy"])
        if hasattr(grid, "load_state_dict") and saved["nodes"] is not None:
            grid.load_state_dict(saved["nodes"])
        restore_rng(saved["rng"])
        clock.now = progress.virtual_time_s
        log.info("resumed from round %d", progress.round)
    run_log = RunLog(out_dir, cfg, resume_round=progress.round)

    header = True
    bar = tqdm(
        total=cfg.rounds, initial=progress.round, desc=cfg.strategy.name, disable=not cfg.progress
    )
    for server_round in range(progress.round + 1, cfg.rounds + 1):
        started = time.perf_counter()
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        down = {m.metadata.dst_node_id: payload_traffic(m.content) for m in messages}
        replies = list(grid.send_and_receive(messages, timeout=cfg.round_timeout_s))
        new_arrays, _ = strategy.aggregate_train(server_round, replies)
        arrays = new_arrays if new_arrays is not None else arrays
        accuracy, loss = evaluate_global(task, arrays)

        up = {
            r.metadata.src_node_id: payload_traffic(r.content) for r in replies if r.has_content()
        }
        work = [_work(r, partitions, down, up) for r in replies if r.has_content()]
        round_time = clock.advance(work)
        bytes_up = sum(t.total for t in up.values())
        bytes_down = sum(t.total for t in down.values())
        payload_up = sum(t.payload for t in up.values())
        payload_down = sum(t.payload for t in down.values())
        progress.round = server_round
        progress.virtual_time_s = clock.now
        progress.wall_time_s += time.perf_counter() - started
        progress.cum_bytes_up += bytes_up
        progress.cum_bytes_down += bytes_down
        progress.cum_payload_bytes_up += payload_up
        progress.cum_payload_bytes_down += payload_down
        row = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "cum_bytes_up": progress.cum_bytes_up,
            "cum_bytes_down": progress.cum_bytes_down,
            "payload_bytes_up": payload_up,
            "payload_bytes_down": payload_down,
            "cum_payload_bytes_up": progress.cum_payload_bytes_up,
            "cum_payload_bytes_down": progress.cum_payload_bytes_down,
            "clients": len(messages),
            "replies": len(work),
            "round_time_s": round_time,
            "virtual_time_s": progress.virtual_time_s,
            "wall_time_s": progress.wall_time_s,
            **strategy.diagnostics(),
        }
        run_log.append(row)
        if cfg.progress:
            _print_row(bar, row, header)
            header = False
        bar.set_postfix(acc=f"{accuracy:.3f}")
        bar.update()
        if server_round % cfg.checkpoint_every == 0 or server_round == cfg.rounds:
            save_checkpoint(
                checkpoint_path,
                {
                    "progress": progress,
                    "arrays": arrays.to_torch_state_dict(),
                    "strategy": strategy.state_dict(),
                    "nodes": grid.state_dict() if hasattr(grid, "state_dict") else None,
                    "rng": rng_state(),
                },
            )
    bar.close()
    torch.save(arrays.to_torch_state_dict(), out_dir / "model.pt")
    return run_log.finish()


def _system_options(cfg: DictConfig) -> dict[str, Any]:
    options = plain(cfg.system)
    options.pop("name", None)
    return options


def _reachable(
    clock: VirtualClock, partitions: dict[int, int], rnd: int, nodes: list[int]
) -> list[int]:
    up = set(clock.available(rnd, range(len(clock.profiles))))
    return [n for n in nodes if partitions.get(n) in up]


def _work(
    reply: Message, partitions: dict[int, int], down: dict[int, Traffic], up: dict[int, Traffic]
) -> ClientWork:
    node = reply.metadata.src_node_id
    metrics = reply.content.metric_records.get("metrics")
    return ClientWork(
        partition=partitions[node],
        samples=cast(int, metrics.get("samples", 0)) if metrics else 0,
        down_bytes=down[node].total if node in down else 0,
        up_bytes=up[node].total,
    )
