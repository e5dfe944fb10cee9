"""A cluster client: one Flower client whose local training runs on N torch.distributed ranks.

Rank 0 is the ClientApp (a SuperNode's `flwr-clientapp` process, or any engine's call);
ranks 1..N-1 are workers that rank 0 starts on its machine for each train instruction,
or that `python -m clients.cluster workers` started once, on any machine, and that join
rank 0 at `cluster-master`. Every rank holds the client's data; each step's global batch
(the trainer's: same seeded permutation, same `batch_size` hook) is cut into per-rank
shares by a `RankBatchSampler`, each rank sums the loss gradient over its share, and one
all-reduce of [Σ_share ∇loss, b_i, loss_i, t_i] gives every rank the full-batch gradient
(LB-BSP's batch-weighted aggregation: the gradient, learning rate and so the trajectory
are a single process's). Rank 0's `ShareController` sizes the next step's shares from the
measured per-rank times: ∝ predicted speed (CPU; last value, EMA or NARX) or the
leader/straggler loop with memory caps (GPU), `fl.mechanisms.lbbsp`. gloo on CPU and in tests,
NCCL on GPUs (which uses InfiniBand/RoCE and GPUDirect by itself).

Turned on by the node config (`flower-supernode --node-config`): `cluster-ranks=N` (N ≥ 2),
optionally `cluster-backend` (gloo | nccl; default nccl where CUDA is), `cluster-controller`
(cpu | gpu), `cluster-predictor` (last | ema | narx), `cluster-caps` ("64,64": per-rank
batch caps, e.g. GPU memory), `cluster-slowdown` ("1,3": emulated per-rank slowdowns, for
demos and tests) and `cluster-master` (HOST:PORT where external workers wait). Without
`cluster-ranks` this ClientApp is `clients.app`'s. Launch: docs/DEPLOYMENT.md, section
"Cluster clients". The strategy's schedule hooks (lr, batch_size, after_step's stop)
run on rank 0 and reach every rank; hooks that change the model or its gradient
(FedProx's before_step, APF's roll-back) run on rank 0, which then re-broadcasts the model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from logging import INFO
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from torch import nn
from torch.utils.data import Sampler

from clients import app as local
from clients.trainer import LocalResult, TrainSettings
from fl.common.config import from_run_config
from fl.common.seeding import derive_seed, pin_torch_threads
from fl.mechanisms.lbbsp import (
    PREDICTORS,
    LeaderStraggler,
    Predictor,
    make_predictor,
    proportional_sizes,
)
from fl.net.transport import bulk_mod
from fl.run.faults import fault_mod
from fl.strategy.client import ClientHooks
from fl.world.task import get_task

__all__ = [
    "ClusterConfig",
    "LeadSchedule",
    "RankBatchSampler",
    "ShareController",
    "app",
    "cluster_check",
    "gpu_cluster_check",
    "train_ranks",
]

app = ClientApp(mods=[bulk_mod, fault_mod])  # as clients.app's: side channel, faults
app.query("info")(local.info)
app.evaluate()(local.evaluate)

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


def _device(kind: str, rank: int) -> torch.device:
    """The CPU, or for `cuda` GPU `rank` mod the GPU count."""
    if kind == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _join(host: str, port: int, rank: int, world: int, backend: str, served: str) -> str | None:
    """Join the process group of the round rank 0 opened at host:port, unless it is the
    one just `served` (rank 0 may not have closed its store yet): that round's token."""
    store = dist.TCPStore(host, port, world, is_master=False, timeout=JOIN_TIMEOUT)
    token = store.get(ROUND_KEY).decode()
    if token == served:
        return None
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(token, store),
        rank=rank,
        world_size=world,
        timeout=JOIN_TIMEOUT,
    )
    return token


def _serve_round(rank: int) -> None:
    """A worker's part of one round: the instruction, the model, the training."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, 0)
    instruction: Instruction = box[0]
    cfg = from_run_config(instruction.run_config)
    pin_torch_threads(cfg.torch_threads)
    task = get_task(cfg)
    device = _device(instruction.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = task.new_model().to(device)
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, 0)
    x, y = (t.to(device) for t in task.client_data(instruction.partition))
    settings = TrainSettings(**instruction.settings)
    slowdown = instruction.slowdown[rank] if instruction.slowdown else 1.0
    train_ranks(model, x, y, settings, None, slowdown)


def worker_main(host: str, port: int, rank: int, world: int, backend: str, rounds: int) -> None:
    """A worker rank: serve `rounds` rounds of rank 0 at host:port (0: until killed)."""
    served, token = 0, ""
    while rounds == 0 or served < rounds:
        try:
            joined = _join(host, port, rank, world, backend, token)
        except (RuntimeError, dist.DistStoreError) as err:  # no rank 0 (yet, or any more)
            if rounds:
                raise
            print(f"worker {rank}: waiting for rank 0 at {host}:{port} ({err})", file=sys.stderr)
            continue
        if joined is None:
            time.sleep(0.2)
            continue
        try:
            _serve_round(rank)
        finally:
            dist.destroy_process_group()
        served, token = served + 1, joined


def _worker_command(master: str, rank: int, config: ClusterConfig, rounds: int) -> list[str]:
    """The command line of one worker rank (`rounds` 0: until stopped)."""
    return [
        *(sys.executable, "-m", "clients.cluster", "worker", "--master", master),
        *("--rank", str(rank), "--ranks", str(config.ranks), "--backend", config.backend),
        *("--rounds", str(rounds)),
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
    device = _device(instruction.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            config.backend,
            store=dist.PrefixStore(token, store),
            rank=0,
            world_size=config.ranks,
            timeout=JOIN_TIMEOUT,
        )
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


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round on the cluster (`cluster-ranks` ≥ 2), else `clients.app`'s local round."""
    config = ClusterConfig.from_node_config(context.node_config)
    if config is None:
        return local.train(msg, context)

    def on_ranks(
        prepared: local.Round, context: Context
    ) -> tuple[LocalResult, Callable[[], dict[str, Any]]]:
        if prepared.setup.dp is not None:
            raise ValueError("privacy=dpsgd does not run on a cluster client (per-rank clipping)")
        instruction = Instruction(
            dict(context.run_config),
            prepared.partition,
            asdict(prepared.settings),
            config.slowdown,
            config.device,
        )
        started = time.perf_counter()
        result, shares = run_cluster_round(
            config, prepared.model, prepared.data, instruction, prepared.hooks
        )
        log(  # in the SuperNode's log: the round ran on the cluster, and how
            INFO,
            "cluster client: %d steps on %d %s ranks (%s), last shares %s, %.1f s",
            *(result.steps, config.ranks, config.backend, config.device, shares),
            time.perf_counter() - started,
        )
        shares_metrics = {f"cluster-share-{r}": s for r, s in enumerate(shares)}
        return result, lambda: {"cluster-ranks": config.ranks, **shares_metrics}

    return local.train_message(msg, context, on_ranks)


# ----- checks and command line -----------------------------------------------------------
class _GradientProbe(ClientHooks):
    """Keeps the gradient of the first step, as the optimizer sees it."""

    first: torch.Tensor | None = None

    def before_step(self, model: nn.Module) -> None:
        if self.first is None:
            grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
            self.first = torch.cat(grads).detach().to("cpu", torch.float64)


def cluster_check(
    ranks: int = 2, backend: str = "gloo", device: str = "cpu", steps: int = 4, batch: int = 96
) -> dict[str, Any]:
    """Real ranks against one process: the first step's gradient and the weights after
    `steps` steps with unequal shares (per-rank caps force them, e.g. 72 + 24 of 96).

    The ranks are processes on this machine (rank 0 here), on loopback; the reference is
    `clients.trainer.train_locally` on the same data, seed and initial weights.
    """
    from clients.trainer import train_locally
    from fl.common.config import compose, to_run_config

    cfg = compose(["partition=iid", "num_clients=2", f"batch_size={batch}", f"local_steps={steps}"])
    task = get_task(cfg)
    caps = tuple(proportional_sizes([float(ranks - r) for r in range(ranks)], batch))
    config = ClusterConfig(ranks, backend, "gpu", "ema", device=device, caps=caps)
    settings = TrainSettings(steps, 0, batch, float(cfg.lr), seed=derive_seed(cfg.seed, 1, 0))
    data = task.client_data(0)
    start = task.new_model()
    reference, model = task.new_model(), task.new_model()
    reference.load_state_dict(start.state_dict())
    model.load_state_dict(start.state_dict())
    alone, together = _GradientProbe(None), _GradientProbe(None)
    instruction = Instruction(to_run_config(cfg), 0, asdict(settings), (), device)
    started = time.perf_counter()
    result, shares = run_cluster_round(config, model, data, instruction, together)
    wall_s = time.perf_counter() - started
    train_locally(reference, *data, alone, settings)
    assert alone.first is not None and together.first is not None
    weights = [
        float((a.double() - b.double()).abs().max())
        for a, b in zip(reference.state_dict().values(), model.state_dict().values(), strict=True)
    ]
    return {
        "ranks": ranks,
        "backend": backend,
        "device": device,
        "shares": shares,
        "steps": result.steps,
        "grad_norm": float(alone.first.norm()),
        "grad_max_abs_diff": float((alone.first - together.first).abs().max()),
        "weights_max_abs_diff": max(weights),
        "wall_s": wall_s,
    }


def _nccl_smoke() -> dict[str, Any]:
    """NCCL with one rank on GPU 0: an all-reduce of CUDA tensors (one GPU allows no more)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False
    )
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        tensor = torch.arange(4, dtype=torch.float32, device="cuda")
        dist.all_reduce(tensor)
        return {"nccl_one_rank_allreduce_ok": tensor.tolist() == [0.0, 1.0, 2.0, 3.0]}
    finally:
        dist.destroy_process_group()


def gpu_cluster_check() -> dict[str, Any]:
    """The cluster client on CUDA: NCCL ranks on ≥ 2 GPUs, else gloo ranks on CUDA tensors
    plus a one-rank NCCL all-reduce; {"skipped": why} without CUDA."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the NCCL cluster-client check needs a GPU"}
    gpus = torch.cuda.device_count()
    out: dict[str, Any] = {"gpus": gpus, "nccl_version": list(torch.cuda.nccl.version())}
    if gpus >= 2:
        out["nccl"] = cluster_check(min(gpus, 4), "nccl", "cuda")
    else:
        out["nccl"] = _nccl_smoke()
        out["gloo_cuda"] = cluster_check(2, "gloo", "cuda")
    return out


def _start_workers(args: argparse.Namespace) -> int:
    """`workers`: ranks first..N-1 on this machine, serving rank 0's rounds until stopped.

    Stopped by SIGTERM (kill, systemd, a test) as by Ctrl-C: it ends its ranks first
    (SIGTERM's default would leave them behind, waiting for rank 0 forever).
    """
    config = ClusterConfig(
        args.ranks, args.backend, device="cuda" if args.backend == "nccl" else "cpu"
    )
    ranks = range(args.first_rank, args.ranks)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs += [subprocess.Popen(_worker_command(args.master, r, config, 0)) for r in ranks]
        return max(p.wait() for p in procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: Sequence[str] | None = None) -> int:
    """`fl-cluster-client` / `python -m clients.cluster`: workers and checks."""
    parser = argparse.ArgumentParser(prog="fl-cluster-client", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("worker", "workers"):
        one = sub.add_parser(
            name, help=f"run {'one worker rank' if name == 'worker' else 'ranks first..N-1'}"
        )
        one.add_argument("--master", required=True, help="HOST:PORT of rank 0 (cluster-master)")
        one.add_argument("--ranks", type=int, required=True, help="N, rank 0 included")
        one.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
        if name == "worker":
            one.add_argument("--rank", type=int, required=True)
            one.add_argument("--rounds", type=int, default=0, help="0: until stopped")
        else:
            one.add_argument("--first-rank", type=int, default=1)
    check = sub.add_parser("check", help="real ranks vs one process (gradient, weights)")
    check.add_argument("--ranks", type=int, default=2)
    check.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    check.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    sub.add_parser("gpu-check", help="the NCCL check on CUDA (skips without a GPU)")
    args = parser.parse_args(argv)
    if args.command == "worker":
        host, port = args.master.rsplit(":", 1)
        worker_main(host, int(port), args.rank, args.ranks, args.backend, args.rounds)
        return 0
    if args.command == "workers":
        return _start_workers(args)
    result = (
        cluster_check(args.ranks, args.backend, args.device)
        if args.command == "check"
        else gpu_cluster_check()
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
