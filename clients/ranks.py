"""The torch.distributed side of a cluster client (`clients.cluster`): what its ranks run.

Here is everything the N ranks of one cluster client share, from rank 0 (the ClientApp)
to the workers: the ranks' set-up (`ClusterConfig`, from the node config), each step's
per-rank shares of the trainer's global batch (`RankBatchSampler`) and rank 0's LB-BSP
`ShareController` that sizes them, the training loop every rank runs together
(`train_ranks`, driven by rank 0's `Lead` through a `LeadSchedule`), and both ends of a
round's rendezvous: rank 0's `run_cluster_round` (which opens the round and starts or
joins the workers) and a worker's `worker_main` (which joins it and serves it). Both ends
live in one module because they are one protocol: the same store key, the same order of
broadcasts (the `Instruction`, the model's tensors, then `train_ranks`). Nothing here
imports Flower (flwr); the ClientApp and the `fl-cluster-client` command line are
`clients.cluster`, which is also what a spawned worker runs (`python -m clients.cluster
worker`, `_worker_command`).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Sampler

from clients.trainer import LocalResult, TrainSettings
from fl.common.config import from_run_config
from fl.common.seeding import pin_torch_threads
from fl.mechanisms.lbbsp import (
    PREDICTORS,
    LeaderStraggler,
    Predictor,
    make_predictor,
    proportional_sizes,
)
from fl.strategy.client import ClientHooks
from fl.world.task import get_task

__all__ = [
    "ClusterConfig",
    "Instruction",
    "Lead",
    "LeadSchedule",
    "RankBatchSampler",
    "ShareController",
    "rank_device",
    "run_cluster_round",
    "train_ranks",
    "worker_main",
]

CONTROLLERS = ("cpu", "gpu")
JOIN_TIMEOUT = datetime.timedelta(minutes=5)  # a rank that never comes fails the round
CODE_ROOT = Path(__file__).resolve().parent.parent  # the checkout, or the FAB, rank 0 runs
ROUND_KEY = "fl-cluster-round"  # rank 0's store names the round it opens (a fresh token)


def _numbers(text: object, key: str) -> tuple[float, ...]:
    """A node config list: "1,3" -> (1.0, 3.0), and a bare number x -> (x,)."""
    try:
        return tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ValueError(f"node config {key}={text!r}: a comma-separated list of numbers") from None


@dataclass(frozen=True)
class ClusterConfig:
    """How one cluster client's ranks are set up (from its node config)."""

    ranks: int
    backend: str = "gloo"
    controller: str = "cpu"
    predictor: str = "ema"
    master: str = ""  # HOST:PORT of external workers; "": rank 0 starts them here
    device: str = "cpu"  # cpu | cuda (rank r on GPU r mod the GPU count); NCCL needs cuda
    slowdown: tuple[float, ...] = ()  # per rank; () = none
    caps: tuple[int, ...] = ()  # per-rank batch caps; () = none

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"cluster-ranks={self.ranks}: a cluster has at least 2 ranks")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"cluster-backend={self.backend!r}: gloo or nccl")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"cluster-controller={self.controller!r}: one of {CONTROLLERS}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"cluster-predictor={self.predictor!r}: one of {PREDICTORS}")
        for name, values in (("slowdown", self.slowdown), ("caps", self.caps)):
            if values and (len(values) != self.ranks or min(values) < 1):
                raise ValueError(f"cluster-{name}: {self.ranks} values >= 1, got {values}")
        if self.device not in ("cpu", "cuda") or (self.backend == "nccl" and self.device != "cuda"):
            raise ValueError(f"cluster-device={self.device!r}: cpu or cuda (nccl needs cuda)")
        if self.master and ":" not in self.master:
            raise ValueError(f"cluster-master={self.master!r}: HOST:PORT")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> ClusterConfig | None:
        """The cluster a node config describes; None without `cluster-ranks` (or with 1)."""
        ranks = node_config.get("cluster-ranks")
        if ranks is None:
            return None
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"node config cluster-ranks={ranks!r}: an integer >= 1")
        if ranks == 1:
            return None
        cuda = torch.cuda.is_available()
        backend = str(node_config.get("cluster-backend", "nccl" if cuda else "gloo"))
        return cls(
            ranks=ranks,
            backend=backend,
            device=str(node_config.get("cluster-device", "cuda" if backend == "nccl" else "cpu")),
            controller=str(node_config.get("cluster-controller", "cpu")),
            predictor=str(node_config.get("cluster-predictor", "ema")),
            master=str(node_config.get("cluster-master", "")),
            slowdown=_numbers(node_config.get("cluster-slowdown", ""), "cluster-slowdown"),
            caps=tuple(
                int(c) for c in _numbers(node_config.get("cluster-caps", ""), "cluster-caps")
            ),
        )


# ----- batching --------------------------------------------------------------------------
# (global batch size, per-rank shares) of a step, given the samples left in the epoch;
# None ends local training. Called on every rank in step, so it may be a collective.
Schedule = Callable[[int, int], tuple[int, list[int]] | None]


class RankBatchSampler(Sampler[list[int]]):
    """This rank's share of each step's global batch.

    Global batches are slices of a seeded permutation per epoch, exactly as the local
    trainer draws them (`clients.trainer`); `schedule` gives each step's global size and
    per-rank shares, which are cut in rank order. `local_steps` > 0: that many steps,
    else `local_epochs` passes.
    """

    def __init__(self, n: int, settings: TrainSettings, rank: int, schedule: Schedule) -> None:
        super().__init__()
        self.n, self.settings, self.rank, self.schedule = n, settings, rank, schedule

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.settings.seed)
        steps, epochs = self.settings.local_steps, self.settings.local_epochs
        step = epoch = 0
        while steps or epoch < epochs:
            order, cursor = torch.randperm(self.n, generator=generator), 0
            while cursor < self.n:
                if steps and step == steps:
                    return
                plan = self.schedule(step, self.n - cursor)
                if plan is None:
                    return
                size, shares = plan
                start = cursor + sum(shares[: self.rank])
                yield order[start : start + shares[self.rank]].tolist()
                cursor, step = cursor + size, step + 1
            epoch += 1


class ShareController:
    """Rank 0's LB-BSP: per-rank shares of each step's global batch from measured times."""

    def __init__(self, config: ClusterConfig) -> None:
        self.kind = config.controller
        self.caps = list(config.caps) or None
        self.predictors: list[Predictor] = [
            make_predictor(config.predictor) for _ in range(config.ranks)
        ]
        self.ranks = config.ranks
        self.loop: LeaderStraggler | None = None

    def shares(self, total: int) -> list[int]:
        """Shares summing to `total` (a rank may get 0 only when total < ranks)."""
        minimum = 1 if total >= self.ranks else 0
        caps = None if self.caps is None else [min(c, total) for c in self.caps]
        if self.kind == "gpu":
            if self.loop is None and minimum:
                self.loop = LeaderStraggler.even(total, caps or [total] * self.ranks)
            if self.loop is not None and sum(self.loop.sizes) == total:
                return list(self.loop.sizes)
            weights = [1.0] * self.ranks if self.loop is None else self.loop.sizes
        else:
            speeds = [p.predict() for p in self.predictors]
            known = all(s is not None and s > 0 for s in speeds)
            weights = cast(list[float], speeds) if known else [1.0] * self.ranks
        return proportional_sizes([max(w, 1e-9) for w in weights], total, caps, minimum)

    def observe(self, shares: Sequence[int], times: Sequence[float]) -> None:
        """One step's shares and per-rank compute seconds."""
        if self.kind == "gpu":
            if self.loop is not None and sum(self.loop.sizes) == sum(shares):
                self.loop.observe(times)
            return
        for predictor, share, seconds in zip(self.predictors, shares, times, strict=True):
            if share > 0 and seconds > 0:
                predictor.observe(share / seconds)


# ----- one rank's training ---------------------------------------------------------------
@dataclass
class Lead:
    """What only rank 0 has: the strategy's hooks and the share controller."""

    hooks: ClientHooks
    controller: ShareController
    shares: list[int] | None = None  # of the step in progress
    stop: bool = False


class LeadSchedule:
    """Each step's plan: rank 0 decides it (hooks, controller) and broadcasts
    [go, global batch, lr, shares...]; every rank returns what it received."""

    def __init__(
        self, lead: Lead | None, settings: TrainSettings, world: int, device: torch.device
    ) -> None:
        self.lead, self.settings, self.world, self.device = lead, settings, world, device
        self.lr = settings.lr  # of the step last planned

    def __call__(self, step: int, remaining: int) -> tuple[int, list[int]] | None:
        message = torch.zeros(3 + self.world, dtype=torch.float64, device=self.device)
        lead = self.lead
        if lead is not None and not lead.stop:
            size = lead.hooks.batch_size(step, self.settings.batch_size)
            lead.shares = lead.controller.shares(min(size, remaining))
            lr = lead.hooks.lr(step, self.settings.lr)
            message[:3] = torch.tensor([1.0, size, lr], dtype=torch.float64)
            message[3:] = torch.tensor(lead.shares, dtype=torch.float64)
        dist.broadcast(message, 0)
        go, size, self.lr, *shares = message.tolist()
        return None if go == 0.0 else (int(size), [int(v) for v in shares])


def _changes_model(hooks: ClientHooks) -> bool:
    """Whether the hooks touch the gradient or the weights (then rank 0 re-broadcasts)."""
    kind = type(hooks)
    return kind.before_step is not ClientHooks.before_step or (
        kind.after_step is not ClientHooks.after_step
    )


def train_ranks(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    settings: TrainSettings,
    lead: Lead | None,
    slowdown: float = 1.0,
) -> LocalResult:
    """Local training of one rank (all ranks call it together in an initialised group).

    SGD with the full-batch gradient of every step's global batch; rank 0 (`lead`)
    decides batches, learning rates and shares. The same result on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = x.device
    schedule = LeadSchedule(lead, settings, world, device)
    sampler = RankBatchSampler(len(y), settings, rank, schedule)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(
        params, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay
    )
    shaping = lead is not None and _changes_model(lead.hooks)
    shaping_flag = torch.tensor([float(shaping)], device=device)
    dist.broadcast(shaping_flag, 0)
    model.train()
    steps = samples = 0
    loss_total = 0.0
    for indices in sampler:
        share = torch.tensor(indices, dtype=torch.long, device=device)
        xb, yb = x[share], y[share]
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr
        optimizer.zero_grad(set_to_none=False)
        started = time.perf_counter()
        loss = (
            F.cross_entropy(model(xb), yb, reduction="sum")
            if len(yb)
            else torch.zeros((), device=device)
        )
        if len(yb):
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        if slowdown > 1.0:  # an emulated slower device: it works `slowdown` times as long
            time.sleep((slowdown - 1.0) * seconds)
            seconds *= slowdown
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        tail = torch.zeros(2 + world, dtype=torch.float64, device=device)
        tail[0], tail[1], tail[2 + rank] = len(yb), float(loss.detach()), seconds
        flat = torch.cat([g.reshape(-1).to(torch.float64) for g in grads] + [tail])
        dist.all_reduce(flat)  # Σ_i b_i·ḡ_i, Σ b_i, Σ loss sums, every rank's time
        count, loss_sum = float(flat[-world - 2]), float(flat[-world - 1])
        mean = flat[: -world - 2] / count
        offset = 0
        for p in params:
            p.grad = mean[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        if lead is not None:
            lead.hooks.before_step(model)
        optimizer.step()
        steps, samples, loss_total = steps + 1, samples + int(count), loss_total + loss_sum
        if lead is not None:
            assert lead.shares is not None
            lead.controller.observe(lead.shares, flat[-world:].tolist())
            lead.hooks.time.samples = samples
            lead.stop = not lead.hooks.after_step(steps, model, torch.tensor(loss_sum / count))
        if shaping_flag.item():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, 0)
    return LocalResult(steps, samples, loss_total / max(samples, 1))


# ----- processes -------------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    """What rank 0 tells the workers at the start of a round (pickled, a few hundred B)."""

    run_config: dict[str, Any]
    partition: int
    settings: dict[str, Any]
    slowdown: tuple[float, ...]
    device: str  # cpu | cuda


def rank_device(kind: str, rank: int) -> torch.device:
    """The device map: the CPU, or for `cuda` GPU `rank` mod the GPU count."""
    if kind == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _init_group(
    backend: str, store: dist.Store, rank: int, world: int, device: torch.device
) -> None:
    """Bind this rank to its device, then join the group (every rank, before any collective).

    With NCCL a rank that is not bound builds its communicator, and the tensors of
    `broadcast_object_list`, on the current device: cuda:0 on every rank of a node. So the
    device is made current first and handed to the group as its `device_id`.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=JOIN_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )


def _join(
    host: str, port: int, rank: int, world: int, backend: str, device: str, served: str
) -> str | None:
    """Join the process group of the round rank 0 opened at host:port, unless it is the
    one just `served` (rank 0 may not have closed its store yet): that round's token."""
    store = dist.TCPStore(host, port, world, is_master=False, timeout=JOIN_TIMEOUT)
    token = store.get(ROUND_KEY).decode()
    if token == served:
        return None
    _init_group(backend, dist.PrefixStore(token, store), rank, world, rank_device(device, rank))
    return token


def _serve_round(rank: int, device_kind: str) -> None:
    """A worker's part of one round: the instruction, the model, the training."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, 0)
    instruction: Instruction = box[0]
    if instruction.device != device_kind:
        raise ValueError(
            f"worker {rank} was started with --device {device_kind}, but rank 0's round "
            f"trains on {instruction.device} (cluster-device)"
        )
    cfg = from_run_config(instruction.run_config)
    pin_torch_threads(cfg.torch_threads)
    task = get_task(cfg)
    device = rank_device(instruction.device, rank)
    model = task.new_model().to(device)
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, 0)
    x, y = (t.to(device) for t in task.client_data(instruction.partition))
    settings = TrainSettings(**instruction.settings)
    slowdown = instruction.slowdown[rank] if instruction.slowdown else 1.0
    train_ranks(model, x, y, settings, None, slowdown)


def worker_main(
    host: str, port: int, rank: int, world: int, backend: str, rounds: int, device: str = ""
) -> None:
    """A worker rank: serve `rounds` rounds of rank 0 at host:port (0: until killed), on
    `device` (cpu | cuda; "": cuda for nccl, else cpu), bound to it before it joins."""
    device = device or ("cuda" if backend == "nccl" else "cpu")
    served, token = 0, ""
    while rounds == 0 or served < rounds:
        try:
            joined = _join(host, port, rank, world, backend, device, token)
        except (RuntimeError, dist.DistStoreError) as err:  # no rank 0 (yet, or any more)
            if rounds:
                raise
            print(f"worker {rank}: waiting for rank 0 at {host}:{port} ({err})", file=sys.stderr)
            continue
        if joined is None:
            time.sleep(0.2)
            continue
        try:
            _serve_round(rank, device)
        finally:
            dist.destroy_process_group()
        served, token = served + 1, joined


def _worker_command(master: str, rank: int, config: ClusterConfig, rounds: int) -> list[str]:
    """The command line of one worker rank (`rounds` 0: until stopped)."""
    return [
        *(sys.executable, "-m", "clients.cluster", "worker", "--master", master),
        *("--rank", str(rank), "--ranks", str(config.ranks), "--backend", config.backend),
        *("--device", config.device, "--rounds", str(rounds)),
    ]


def _spawn_workers(port: int, config: ClusterConfig) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..N-1 on this machine, for one round, running rank 0's own code.

    Under a SuperNode rank 0 runs the submitted App's code from the FAB Flower installed
    (not what the working directory or the environment would import): the workers
    import theirs from the same place (PYTHONPATH first, the working directory, where
    they load data as rank 0 does, kept off sys.path by PYTHONSAFEPATH).
    """
    master = f"127.0.0.1:{port}"
    path = os.pathsep.join(filter(None, [str(CODE_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONSAFEPATH": "1"}
    commands = [_worker_command(master, r, config, 1) for r in range(1, config.ranks)]
    return [subprocess.Popen(command, env=env) for command in commands]


def run_cluster_round(
    config: ClusterConfig,
    model: nn.Module,
    data: tuple[torch.Tensor, torch.Tensor],
    instruction: Instruction,
    hooks: ClientHooks,
) -> tuple[LocalResult, list[int]]:
    """Rank 0's round: start or join the workers, broadcast, train; (result, last shares)."""
    host, port = ("127.0.0.1", 0) if not config.master else config.master.rsplit(":", 1)
    store = dist.TCPStore(
        str(host),
        int(port),
        config.ranks,
        is_master=True,
        timeout=JOIN_TIMEOUT,
        wait_for_workers=False,
    )
    token = uuid.uuid4().hex
    store.set(ROUND_KEY, token)
    workers = [] if config.master else _spawn_workers(store.port, config)
    device = rank_device(instruction.device, 0)
    try:
        _init_group(config.backend, dist.PrefixStore(token, store), 0, config.ranks, device)
        try:
            dist.broadcast_object_list([instruction], 0)
            model.to(device)
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, 0)
            lead = Lead(hooks, ShareController(config))
            settings = TrainSettings(**instruction.settings)
            x, y = (t.to(device) for t in data)
            slowdown = config.slowdown[0] if config.slowdown else 1.0
            result = train_ranks(model, x, y, settings, lead, slowdown)
        finally:
            dist.destroy_process_group()
        model.to("cpu")
    finally:
        for worker in workers:
            if worker.wait(timeout=JOIN_TIMEOUT.total_seconds()) != 0:
                raise RuntimeError(f"cluster worker exited with {worker.returncode}")
    return result, lead.shares or []
