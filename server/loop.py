"""The synchronous round loop: select, send, aggregate, evaluate, clock, log, checkpoint.

Written once for every strategy and engine. The strategy decides who trains and what
each node receives and how replies are combined; this loop counts the bytes each
message puts on the link, advances the virtual clock, and makes the run resumable.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from omegaconf import DictConfig

from fl.common.config import plain
from fl.common.errors import RunError
from fl.common.files import write_atomic
from fl.mechanisms.robust import example_bounds, robust_options
from fl.run.arrivals import RealArrivals
from fl.run.checkpoint import (
    CHECKPOINT,
    PREVIOUS,
    CheckpointError,
    check_contents,
    check_resumable,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from fl.run.console import RoundReporter
from fl.run.engines.carriers import carrier_grid, expects_cohort_replies
from fl.run.loops import Landed, LoopSettings, RoundDriver, WorkBounds, loop_settings
from fl.run.tracking import RunLog, clear_run, holds_run, refuse_existing_run
from fl.strategy.registry import get_strategy
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.codec import CODEC, Traffic, payload_traffic
from fl.wire.contract import check_reply_error
from fl.wire.records import items_of, required_record, torch_state
from fl.world.clock import VirtualClock, clock_from_config
from fl.world.population import NodeIds, nodes_by_partition
from fl.world.task import Task, get_task
from privacy.central import wrap_central_dp
from privacy.rounds import RoundPrivacy
from server.evaluation import evaluate_global
from server.nodes import discover_partitions

__all__ = ["Progress", "make_strategy", "run_training"]

log = logging.getLogger(__name__)
REPLY_WAIT_S = 3600.0  # real seconds a real engine waits for replies when no deadline is set
DEADLINE_FACTOR = 2.0  # default virtual deadline: this many times the slowest expected round


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

    def add_traffic(self, up: Iterable[Traffic], down: Iterable[Traffic]) -> dict[str, int]:
        """Count one round's traffic; return its columns for the metrics row."""
        up, down = list(up), list(down)
        row = {
            "bytes_up": sum(t.total for t in up),
            "bytes_down": sum(t.total for t in down),
            "payload_bytes_up": sum(t.payload for t in up),
            "payload_bytes_down": sum(t.payload for t in down),
        }
        self.cum_bytes_up += row["bytes_up"]
        self.cum_bytes_down += row["bytes_down"]
        self.cum_payload_bytes_up += row["payload_bytes_up"]
        self.cum_payload_bytes_down += row["payload_bytes_down"]
        return {
            **row,
            "cum_bytes_up": self.cum_bytes_up,
            "cum_bytes_down": self.cum_bytes_down,
            "cum_payload_bytes_up": self.cum_payload_bytes_up,
            "cum_payload_bytes_down": self.cum_payload_bytes_down,
        }


def make_strategy(cfg: DictConfig) -> ServerStrategy:
    """The configured strategy's server half (inside Flower's central-DP wrapper if set)."""
    values = plain(cfg.strategy)
    spec = get_strategy(str(values["name"]))
    strategy = spec.server(
        spec.make_params(values),
        seed=cfg.seed,
        clients_per_round=cfg.clients_per_round,
        max_update_norm=float(cfg.max_update_norm),
        strategy_name=spec.name,
        **robust_options(cfg),
    )
    return wrap_central_dp(strategy, cfg)


def _restore(
    saved: dict[str, Any], strategy: ServerStrategy, grid: Grid
) -> tuple[Progress, dict[str, Any], list[dict[str, Any]]]:
    """Counters, global model and metrics rows of a checkpoint; restores strategy, nodes, RNGs.

    What the checkpoint holds is checked (`check_contents`), and a state its strategy,
    engine or RNGs cannot take is a CheckpointError, not a traceback."""
    try:
        strategy.load_state_dict(saved["strategy"])
        if hasattr(grid, "load_state_dict") and saved["nodes"] is not None:
            grid.load_state_dict(saved["nodes"])
        restore_rng(saved["rng"])
        progress = Progress(**saved["progress"])
    except CheckpointError:
        raise
    except Exception as err:  # any field of the wrong kind: refused, never half-applied on
        raise CheckpointError(f"checkpoint: its state does not fit this run: {err!r}") from None
    log.info("resumed from round %d", progress.round)
    return progress, saved["arrays"], list(saved["rows"])


def run_training(grid: Grid, cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run (or resume) `cfg.rounds` rounds on `grid`; write outputs to `out_dir`."""
    checkpoint_path = out_dir / CHECKPOINT
    resume = bool(cfg.resume)
    checkpoints = (checkpoint_path, out_dir / PREVIOUS)
    if resume and holds_run(out_dir) and not any(p.exists() for p in checkpoints):
        # killed after its first outputs, before its first checkpoint: nothing to continue
        log.warning("%s has no checkpoint yet: the run starts again at round 1", out_dir)
        clear_run(out_dir)
        resume = False
    saved = load_checkpoint(checkpoint_path) if resume else None
    if saved is not None:  # before anything is built or written
        check_resumable(saved["config"], plain(cfg))
    else:
        refuse_existing_run(out_dir, resume=False, overwrite=bool(cfg.get("overwrite")))
        clear_run(out_dir)  # what overwrite=true allowed to replace
    task = get_task(cfg)
    strategy = make_strategy(cfg)
    partitions = discover_partitions(grid, cfg.num_clients)
    strategy.bound_examples(example_bounds(cfg, task, partitions))
    system = _system_options(cfg)
    aggregation_s = float(system.pop("aggregation_s_per_update", 0.0))
    clock = clock_from_config(system, cfg.num_clients, cfg.seed)
    settings = loop_settings(cfg)
    grid = carrier_grid(grid, cfg, partitions, settings.arrival)  # flower-sim cohorts
    progress, state = Progress(), task.new_model().state_dict()
    rows: list[dict[str, Any]] = []
    if saved is not None:
        check_contents(saved, state)
        progress, state, rows = _restore(saved, strategy, grid)
    real = None
    if settings.arrival == "real":
        real = RealArrivals(grid, partitions, started_s=progress.virtual_time_s)
    deadline_s = _deadline_s(cfg, task, clock, real)
    schedule = strategy.group_schedule()  # R2SP: groups start in turn
    strategy.cohort_replies = expects_cohort_replies(cfg)
    driver = RoundDriver(
        settings, clock, partitions, deadline_s, real, schedule, strategy.cohort_replies
    )
    by_partition = nodes_by_partition(partitions, cfg.num_clients)
    strategy.attach(
        reachable=lambda rnd, grid: driver.idle(_reachable(clock, by_partition, rnd, grid)),
        extra_config=lambda node: _time_view(clock, partitions[node], driver.client_deadline_s),
        staleness_exponent=settings.staleness_exponent,
    )

    if saved is not None:
        try:
            driver.load_state_dict(saved["loop"])
        except Exception as err:
            raise CheckpointError(f"checkpoint: its loop state does not fit: {err!r}") from None
    arrays = ArrayRecord(state)
    privacy = RoundPrivacy(cfg, task, out_dir)  # ε per client; ledger grant and charges
    privacy.load_state_dict(progress.extra.get("privacy", {}))
    refused = privacy.start()
    if refused:  # no grant: nothing is trained or written
        raise RunError(refused)
    run_log = RunLog(out_dir, cfg, rows)
    stop: str | None = None

    reporter = RoundReporter(
        cfg.rounds,
        progress.round,
        cfg.strategy.name,
        enabled=bool(cfg.progress),
        arrival=settings.arrival,  # real arrivals: the time column is wall time
    )
    budget = cfg.get("time_budget_s") or float("inf")
    for server_round in range(progress.round + 1, cfg.rounds + 1):
        if progress.virtual_time_s >= budget:
            log.info("virtual-time budget of %s s reached after round %d", budget, progress.round)
            break
        driver.sync_clock()
        started, started_s = time.perf_counter(), clock.now
        up: list[Traffic] = []
        down: list[Traffic] = []
        sent = 0
        for exchange in itertools.count(1):  # one, unless the strategy asks for more
            exchange_s = clock.now
            if exchange == 1:  # cancelled before selection: idle, so they may be asked anew
                strategy.give_up(driver.cancel(strategy.resync(server_round, driver.in_flight())))
            reachable = len(driver.idle(_reachable(clock, by_partition, server_round)))
            strategy.plan(driver.wanted(cfg.clients_per_round, reachable))
            config = ConfigRecord(privacy.train_config())  # the strategy stamps its own name
            messages = list(strategy.configure_train(server_round, arrays, config, grid))
            chosen = [partitions[m.metadata.dst_node_id] for m in messages]
            stop = stop or privacy.admit(server_round, chosen)
            if stop:  # over the privacy budget: end here, keeping the model so far
                log.warning("%s", stop)
                break
            landed, asked_down = _send(
                server_round, exchange_s, messages, strategy, driver, grid, cfg, task, partitions
            )
            for reply in landed.replies:  # a ClientApp running another half stops the run
                check_reply_error(reply)
            accepted_before = strategy.stats.accepted
            new_arrays, _ = strategy.aggregate_train(server_round, landed.replies)
            strategy.give_up(landed.given_up, landed.delivered)
            arrays = new_arrays if new_arrays is not None else arrays
            up, down, sent = up + landed.up, down + asked_down, sent + len(messages)
            if real is None:  # the server's own work
                clock.wait(aggregation_s * (strategy.stats.accepted - accepted_before))
            if not strategy.another_exchange(server_round, exchange):
                break
        if sent == 0 and stop:
            break
        driver.sync_clock()
        final = server_round == cfg.rounds or clock.now >= budget or bool(stop)
        scores: dict[str, float] = {}  # none on the rounds between evaluations
        if final or server_round % cfg.evaluate_every == 0:
            accuracy, loss = evaluate_global(task, arrays)
            driver.sync_clock()
            strategy.on_round_end(server_round, accuracy, loss, clock.now)
            scores = {"accuracy": accuracy, "loss": loss}

        progress.round = server_round
        progress.virtual_time_s = clock.now
        progress.wall_time_s += time.perf_counter() - started
        row = {
            "round": server_round,
            **scores,
            **progress.add_traffic(up, down),
            "clients": sent,
            "replies": strategy.stats.accepted,
            "round_time_s": clock.now - started_s,
            "virtual_time_s": progress.virtual_time_s,
            "wall_time_s": progress.wall_time_s,
            **_staleness(strategy.stats.updates, settings),
            **strategy.diagnostics(),
            **(grid.diagnostics() if hasattr(grid, "diagnostics") else {}),  # fl.net.transport
            **privacy.observe(strategy.stats.updates, partitions),
        }
        run_log.append(row)
        progress.extra["privacy"] = privacy.state_dict()
        reporter.round_done(row)
        last = final or progress.virtual_time_s >= budget  # a real clock runs on while testing
        if server_round % cfg.checkpoint_every == 0 or last:
            save_checkpoint(
                checkpoint_path,
                {
                    "config": plain(cfg),
                    "progress": asdict(progress),
                    "rows": run_log.rows,
                    "arrays": torch_state(arrays),
                    "strategy": strategy.state_dict(),
                    "nodes": grid.state_dict() if hasattr(grid, "state_dict") else None,
                    "loop": driver.state_dict(),
                    "rng": rng_state(),
                },
            )
        if stop:  # the privacy budget ended the round's exchanges: no further round
            break
    privacy.finish()
    if stop and progress.round == 0:
        raise RunError(f"{stop}; no round was trained, so no model was written")
    final = torch_state(arrays)
    write_atomic(out_dir / "model.pt", lambda f: torch.save(final, f))
    summary = run_log.finish(privacy.summary())
    reporter.close(summary, out_dir)
    return summary


def _send(
    server_round: int,
    started_s: float,
    messages: list[Message],
    strategy: ServerStrategy,
    driver: RoundDriver,
    grid: Grid,
    cfg: DictConfig,
    task: Task,
    partitions: Mapping[int, int],
) -> tuple[Landed, list[Traffic]]:
    """Send one exchange's instructions and wait for its close: what landed, bytes sent."""
    down = _sent_traffic(messages)
    if driver.real is not None:
        driver.push(server_round, strategy.global_vector, messages, down)
        missing: list[int] = []
    else:
        work = _Work(
            cfg.local_steps,
            cfg.batch_size,
            cfg.local_epochs,
            strategy.min_local_steps,
            cfg.privacy.name == "dpsgd" and cfg.privacy.get("sampling") == "poisson",
        )
        asked = {
            m.metadata.dst_node_id: _asked_samples(m, work, task, partitions) for m in messages
        }
        wait_s = cfg.round_timeout_s or REPLY_WAIT_S
        replies = list(grid.send_and_receive(messages, timeout=wait_s)) if messages else []
        missing = driver.dispatch(
            server_round, strategy.global_vector, replies, down, asked, strategy.reply_parts
        )
    close_at = strategy.arrivals_to_close(server_round)
    reserve = strategy.reserve_arrivals(server_round)
    landed = driver.close(server_round, started_s, len(messages), missing, close_at, reserve)
    strategy.expect(landed.info)
    return landed, list(down.values())


def _sent_traffic(messages: list[Message]) -> dict[int, Traffic]:
    """Bytes each instruction carries, measured from its arrays; arrays several
    instructions share (the broadcast model) are measured once, not once per node."""
    measured: dict[tuple[tuple[str, int], ...], Traffic] = {}
    out = {}
    for message in messages:
        content = message.content
        shared = tuple(
            (k, id(v)) for k, v in content.items() if k == CODEC or isinstance(v, ArrayRecord)
        )
        if shared not in measured:
            measured[shared] = payload_traffic(content)
        out[message.metadata.dst_node_id] = measured[shared]
    return out


def _staleness(updates: list[ClientUpdate], settings: LoopSettings) -> dict[str, Any]:
    """Staleness of the aggregated replies (only where replies may land late)."""
    if not settings.stale:
        return {}
    values = [u.staleness for u in updates]
    return {
        "staleness_mean": sum(values) / len(values) if values else 0.0,
        "staleness_max": max(values, default=0),
    }


def _time_view(clock: VirtualClock, partition: int, deadline_s: float) -> dict[str, Any]:
    """What a client's hooks may know of time: its device, the round's deadline and, under
    a speed trace, its speed's changes until the deadline (seconds after sending, samples/s,
    flattened): the device's own clock, which a real client reads off its wall clock."""
    profiles = clock.profiles  # read from its arrays: no DeviceProfile built per node
    view = {
        "device-speed": clock.speed(partition, clock.now),
        "device-up-bps": float(profiles.up[partition]),
        "device-down-bps": float(profiles.down[partition]),
        "deadline-s": deadline_s,
        "sent-at-s": clock.now,
    }
    if clock.speed_trace is not None:
        segments = clock.speed_segments(partition, clock.now, clock.now + deadline_s)
        view["device-speed-trace"] = [float(x) for segment in segments for x in segment]
    return view


def _system_options(cfg: DictConfig) -> dict[str, Any]:
    options = plain(cfg.system)
    options.pop("name", None)
    return options


def _deadline_s(
    cfg: DictConfig, task: Task, clock: VirtualClock, real: RealArrivals | None
) -> float:
    """Seconds the server waits for a round's replies (wall seconds for real arrivals).

    `loop.deadline_s`, else `round_timeout_s`, else for real arrivals REPLY_WAIT_S, and
    for virtual ones DEADLINE_FACTOR times the round of the
    slowest device doing the configured work on the largest partition with a dense model
    both ways, plus every selected client's transfers queued on the server link (our
    choice of default: the papers we follow do not fix one).
    """
    for value in (cfg.loop.get("deadline_s"), cfg.round_timeout_s):
        if value is not None:
            return float(value)
    if real is not None:
        return REPLY_WAIT_S
    largest = int(task.sizes.max())
    samples = _samples(cfg.local_steps, cfg.batch_size, cfg.local_epochs, largest)
    model_bytes = 4 * task.layout.numel  # float32 on the wire
    slowest = clock.profiles.max_seconds(samples, model_bytes, model_bytes)
    queued = 2 * cfg.clients_per_round * model_bytes / clock.server_bytes_per_s
    return DEADLINE_FACTOR * (slowest + queued)


def _reachable(
    clock: VirtualClock, by_partition: NodeIds, rnd: int, grid: Grid | None = None
) -> NodeIds:
    """The nodes reachable in round `rnd`, in partition order; with `grid`, only those it
    still has (a deployment's nodes may leave; an in-process population cannot)."""
    reachable = clock.reachable(rnd)
    known = getattr(grid, "partition_map", None)
    if grid is not None and not (callable(known) and known() is not None):
        connected = np.fromiter(grid.get_node_ids(), dtype=np.uint64)
        reachable &= np.isin(by_partition.ids, connected)
    return by_partition.where(reachable)


@dataclass(frozen=True)
class _Work:
    """The run's local work per round, read from the config once rather than per message."""

    local_steps: int
    batch_size: int
    local_epochs: int
    min_steps: int | None = None  # the strategy's `min_local_steps`
    random_batches: bool = False  # DP-SGD's Poisson batches: any count is honest


def _asked_samples(
    message: Message, work: _Work, task: Task, partitions: Mapping[int, int]
) -> WorkBounds:
    """The fewest samples one node may honestly process this round, and the most it was
    asked for: steps x batch size, or epochs x examples.

    Read from the node's own instruction, where a strategy's per-round keys (GIFT's
    `local-steps`, LB-BSP's `batch-size`) override the run's, as the ClientApp applies
    them; the examples are those of the partition the server knows the node holds. The
    clock charges a reply's reported samples clamped to these bounds: a reply claiming no
    work gets no free time.
    """
    config = items_of(required_record(message.content, "config", ConfigRecord))
    steps = int(cast(int, config.get("local-steps", work.local_steps)))
    batch = int(cast(int, config.get("batch-size", work.batch_size)))
    epochs = int(cast(int, config.get("local-epochs", work.local_epochs)))
    examples = int(task.sizes[partitions[message.metadata.dst_node_id]])
    asked = _samples(steps, batch, epochs, examples)
    if work.random_batches:
        return WorkBounds(0, asked)
    return WorkBounds(_honest_samples(steps, batch, epochs, examples, work.min_steps), asked)


def _honest_samples(
    steps: int, batch: int, epochs: int, examples: int, min_steps: int | None
) -> int:
    """Samples the trainer processes: index batches of `batch` sliced from a shuffle of
    `examples` (a pass's last batch holds what is left), for `steps` steps or `epochs`
    passes; only `min_steps` where the strategy lets a client stop early."""
    per_pass = -(-examples // batch)  # steps in one pass over the examples
    total = steps if steps > 0 else epochs * per_pass
    if min_steps is not None:
        total = min(total, min_steps)
    return (total // per_pass) * examples + (total % per_pass) * batch


def _samples(steps: int, batch_size: int, epochs: int, examples: int) -> int:
    """Samples of one round of local work: steps x batch size, or epochs x examples."""
    return steps * batch_size if steps > 0 else epochs * examples
