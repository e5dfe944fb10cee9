"""Many-client FedAvg benchmark: plain PyTorch loop vs our local engine (client by client,
and as one cohort: `engine.cohort=auto`) vs vanilla Flower (`run_simulation`, 2 Ray actors);
with `--arms`, also ours on Flower's Ray simulation like vanilla Flower's arm (`sim`: a
message per node; `sim_cohort`: `engine.cohort=auto`, a round as two envelopes, each trained
as one cohort by one actor), and `imports`: a process that imports the modules the cohort
arm's run imported, in its order, and runs nothing (the floor of the cohort's CPU seconds;
Flower's CPU seconds ÷ it are the most the issue-37 CPU goal could reach).

What every arm does alike: the same workload (Synthetic-IID, 20 features, 10 classes,
MLP 20-32-10, one epoch of batch-16 SGD per client; the model learns: chance, the majority
class, is 0.36), the same batches, and inside its timer the rounds and a test evaluation of
the global model after every round. One-time imports are warmed before any timer
(`torch._dynamo`, which `torch.optim.SGD` imports on first construction: 1–2 CPU s; the
cohort arm never imports it, so it does not pay for it, and fails if it ever does), except
in Flower's 2 Ray actors, which are separate processes started inside its run (their start
is part of Flower's in-process time; Flower is compared on CPU seconds and paired walls,
start-up included for every arm). Every arm builds its clients' data before its timer:
plain and Flower in their own code, ours because every client trains in round 1, which
makes the local engine build the population first (`Task.build_clients`; until
2026-12-06 ours made each client's data inside round 1, ~12 % of the cohort's three
rounds, labelled then as a difference). Our arms write no plots (`plots=false`) and one
checkpoint, after the last round and outside their in-process timer
(`checkpoint_every=rounds`). Ratios are paired: each
repeat runs every arm once, interleaved, and a ratio is the median of the repeats' ratios.
The matmul ceiling (GFLOP/s of one single-threaded MKL matmul, measured here) puts each
arm's training FLOPs in proportion: the fraction of the ceiling its rounds reach.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import ctypes
import importlib
import itertools
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from fl import OFFLINE_ENV  # telemetry, usage stats and update checks off
from fl.common.files import write_atomic

REPO = Path(__file__).resolve().parent.parent
ARMS = ("plain", "ours", "cohort", "imports", "flower", "sim", "sim_cohort")
DEFAULT_ARMS = ("plain", "ours", "cohort", "flower")
OURS = ("ours", "cohort", "sim", "sim_cohort")  # fl-run arms; *cohort: engine.cohort=auto
ON_RAY = ("flower", "sim", "sim_cohort")  # 2 Ray actors, in a loopback-only namespace
SEED = 0  # conf/config.yaml's seed
# Synthetic-IID with 10 classes learns (0.36 -> 0.68 test accuracy in 3 rounds of 1000
# clients); the non-IID 2-class variant this benchmark used ended at 0.50, chance.
DIM, NUM_CLASSES, SAMPLES_PER_DEVICE, HIDDEN, IID = 20, 10, 60, (32,), True
BATCH_SIZE, LOCAL_EPOCHS = 16, 1
# fl-run with its one-time imports warmed first, as the plain arm warms them before its timer
WARM_RUN = 'import sys, torch._dynamo; from fl.run.cli import main; sys.argv[0] = "fl-run"; main()'
# the cohort arm trains without torch.optim and never imports torch._dynamo (~1 CPU s): it
# starts without it, and fails if a run of it imported it after all (then warm it again)
# (and leaves the names of the modules it imported, in order, where BENCH_MODULES says,
# if it says, never through a link: bench_scale.py runs this arm without it)
COHORT_RUN = (
    'import sys; from fl.run.cli import main; sys.argv[0] = "fl-run"; main(); '
    'assert "torch._dynamo" not in sys.modules, "the cohort arm imported torch._dynamo"; '
    "import json, os; from fl.common.files import write_atomic; "
    "path = os.environ.get('BENCH_MODULES')\n"
    "if path:\n"
    "    write_atomic(path, json.dumps(list(sys.modules)))"
)
# the floor of the cohort arm's CPU seconds: the modules its run imported, imported in the
# same order and nothing run (a few extensions' private names import only through their
# package: skipped). The names come from a file, so they are checked first: a regular file,
# a bounded list of dotted module names (sysconfig's data module has a hyphen).
IMPORTS_RUN = """import importlib, json, os, re
from fl.common.files import read_regular_text
names = json.loads(read_regular_text(os.environ["BENCH_MODULES"]))
dotted = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\\.[A-Za-z_][A-Za-z0-9_-]*)*")  # sysconfig's has -
ok = isinstance(names, list) and len(names) <= 20000
if not (ok and all(isinstance(n, str) and dotted.fullmatch(n) for n in names)):
    raise SystemExit("imports arm: the cohort's module list is not a list of module names")
for name in names:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
"""
CHECK_GOALS = {"cohort_ratio": 0.12, "flower_cpu": 25.0, "rss_mb": 1024.0}
SAMPLE_EVERY_S = 0.2
PR_SET_CHILD_SUBREAPER = 36


# ----- the workload, shared by the plain arm and the Flower ClientApp -----------------------


def config_lr() -> float:
    """The learning rate our framework uses by default (conf/config.yaml)."""
    from omegaconf import OmegaConf

    return float(OmegaConf.load(REPO / "conf" / "config.yaml").lr)


@lru_cache(maxsize=2)
def workload(clients: int) -> tuple[Any, list[np.ndarray]]:
    """The synthetic dataset with one natural partition per client, built once per process."""
    from fl.world.data import load_dataset
    from fl.world.partition import partition_indices

    data = load_dataset(
        "synthetic",
        seed=SEED,
        num_devices=clients,
        dim=DIM,
        num_classes=NUM_CLASSES,
        samples_per_device=SAMPLES_PER_DEVICE,
        iid=IID,
    )
    parts = partition_indices(
        data.y_train.numpy(), clients, "natural", seed=SEED, groups=data.groups
    )
    return data, parts


def initial_model() -> Any:
    """The MLP 20-32-10 with the initial weights our engine starts from (seeded build)."""
    import torch

    from fl.world.models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return build_model("mlp", (DIM,), NUM_CLASSES, hidden=HIDDEN)


def client_seed(server_round: int, partition: int) -> int:
    """The per-client shuffle seed our ClientApp derives, so all arms see the same batches."""
    return int(np.random.SeedSequence([SEED, server_round, partition]).generate_state(1)[0])


def train_one_client(
    model: Any, x: Any, y: Any, lr: float, server_round: int, partition: int
) -> None:
    """One epoch of minibatch SGD over (x, y), in place, batches from a seeded permutation."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(client_seed(server_round, partition))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(LOCAL_EPOCHS):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), BATCH_SIZE):
            batch = order[start : start + BATCH_SIZE]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()


def plain_fedavg_round(
    model: Any, global_state: dict[str, Any], clients: Any, lr: float, server_round: int
) -> dict[str, Any]:
    """One plain-PyTorch FedAvg round over `clients` ((partition, x, y) in order): each
    trains from `global_state`; returns their example-weighted mean as a new state_dict."""
    import torch

    states, weights = [], []
    for partition, x, y in clients:
        model.load_state_dict(global_state)
        train_one_client(model, x, y, lr, server_round, partition)
        states.append(torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()]))
        weights.append(len(y))
    w = torch.tensor(weights, dtype=torch.float64)
    mean = ((w / w.sum()) @ torch.stack(states).double()).float()
    flat = torch.split(mean, [v.numel() for v in global_state.values()])
    return {
        k: p.reshape(v.shape).clone() for (k, v), p in zip(global_state.items(), flat, strict=True)
    }


def test_accuracy(model: Any, data: Any) -> float:
    """Accuracy of `model` on the synthetic test split."""
    import torch

    model.eval()
    with torch.no_grad():
        return float((model(data.x_test).argmax(1) == data.y_test).float().mean())


# ----- arm workers (run in their own process) -----------------------------------------------


def plain_worker(clients: int, rounds: int, result: Path) -> None:
    """Arm `plain`: for each round, each client in order: load, train, collect; then average."""
    import torch
    import torch._dynamo  # one-time import of torch.optim.SGD: outside the timer

    torch.set_num_threads(1)  # as our engine (torch_threads=1)
    lr = config_lr()
    data, parts = workload(clients)
    model = initial_model()
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    started = time.perf_counter()
    for server_round in range(1, rounds + 1):
        clients = (
            (partition, data.x_train[torch.from_numpy(i)], data.y_train[torch.from_numpy(i)])
            for partition, i in enumerate(parts)
        )
        global_state = plain_fedavg_round(model, global_state, clients, lr, server_round)
        model.load_state_dict(global_state)
        accuracy = test_accuracy(model, data)  # every round, as our loop evaluates
    train_s = time.perf_counter() - started
    result.write_text(json.dumps({"accuracy": accuracy, "in_process_s": train_s}))


def flower_train(msg: Any, context: Any) -> Any:
    """The vanilla Flower ClientApp's train: load arrays, one epoch of SGD, reply + num-examples.

    Module level, so Ray pickles it by reference and each actor keeps its caches.
    """
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    torch.set_num_threads(1)
    clients = int(context.node_config["num-partitions"])
    partition = int(context.node_config["partition-id"])
    data, parts = workload(clients)
    model = _actor_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    idx = torch.from_numpy(parts[partition])
    x, y = data.x_train[idx], data.y_train[idx]
    server_round = int(msg.content["config"]["server-round"])
    train_one_client(model, x, y, _lr(), server_round, partition)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(y)}),
        }
    )
    return Message(content=content, reply_to=msg)


@lru_cache(maxsize=1)
def _actor_model() -> Any:
    """One reusable model per Ray actor process."""
    return initial_model()


@lru_cache(maxsize=1)
def _lr() -> float:
    return config_lr()


def flower_worker(clients: int, rounds: int, result: Path) -> None:
    """Arm `flower`: run_simulation of FedAvg.start with 2 Ray actors (1 CPU per client)."""
    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    client = ClientApp()
    client.train()(flower_train)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_available_nodes=clients,
            min_train_nodes=clients,
        )
        model = initial_model()
        data = workload(clients)[0]
        accuracy: list[float] = []

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            """The test accuracy after every round, as our loop (not of the initial model)."""
            if server_round == 0:
                return None
            model.load_state_dict(arrays.to_torch_state_dict())
            accuracy.append(test_accuracy(model, data))
            return MetricRecord({"accuracy": accuracy[-1]})

        started = time.perf_counter()
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=rounds,
            evaluate_fn=evaluate,
        )
        train_s = time.perf_counter() - started
        result.write_text(json.dumps({"accuracy": accuracy[-1], "in_process_s": train_s}))

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )


# ----- measuring one run --------------------------------------------------------------------


@dataclass
class Run:
    """One arm's run: what was launched and what it cost."""

    arm: str
    repeat: int
    command: list[str]
    wall_s: float = 0.0
    returncode: int | None = None
    peak_rss_mb: float = 0.0
    peak_pss_mb: float = 0.0
    cpu_s: float = 0.0  # user + system CPU of the whole process tree
    load1: float = 0.0  # the machine's 1-minute load average at launch
    foreign_cpu_s: float = 0.0  # CPU used meanwhile by processes outside this benchmark
    waited_s: float = 0.0  # how long we waited for the machine to go quiet before launch
    max_processes: int = 0
    lingering: int = 0  # descendants still alive when the arm's process exited
    accuracy: float | None = None
    in_process_s: float | None = None
    log: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class TreeSampler(threading.Thread):
    """Samples the summed RSS and PSS, and each process's CPU time, of all our descendants."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.peak_rss = self.peak_pss = 0
        self.max_processes = 0
        self.cpu_s: dict[int, float] = {}  # last user + system CPU seen per pid

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            rss = pss = count = 0
            for proc in me.children(recursive=True):
                try:
                    with proc.oneshot():
                        info, cpu = proc.memory_full_info(), proc.cpu_times()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                rss, pss, count = rss + info.rss, pss + info.pss, count + 1
                self.cpu_s[proc.pid] = cpu.user + cpu.system
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self.max_processes = max(self.max_processes, count)
            self.stop.wait(SAMPLE_EVERY_S)


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot, all cores together."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def wait_for_quiet(max_wait_s: float, busy_below: float = 15.0) -> float:
    """Wait (at most `max_wait_s`) until the machine is nearly idle; returns the seconds waited.

    Other jobs on a shared machine inflate wall times; this keeps them out where it can.
    """
    started = time.perf_counter()
    while time.perf_counter() - started < max_wait_s:
        if psutil.cpu_percent(interval=1.0) < busy_below:
            break
    return time.perf_counter() - started


def reap_descendants(timeout_s: float = 5.0) -> int:
    """Terminate, then kill, every process still below us (Ray daemons); returns how many."""
    left = psutil.Process().children(recursive=True)
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(left, timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=timeout_s)
    return len(left)


def measure(run: Run, env: dict[str, str], log_path: Path, timeout_s: float) -> None:
    """Launch `run.command`, time it to exit and sample its process tree's memory."""
    sampler = TreeSampler()
    run.load1 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, self_before = _busy_cpu_s(), time.process_time()
    with log_path.open("w") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(
            run.command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        sampler.start()
        try:
            run.returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            run.returncode = proc.wait()
            run.extra["timed_out"] = True
        run.wall_s = time.perf_counter() - started
    sampler.stop.set()
    sampler.join()
    run.lingering = reap_descendants()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Reaped descendants are exact; Ray's daemons and actors may never be reaped by their
    # parents, so their sampled CPU (short by at most one interval each) can be the larger.
    reaped = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    run.cpu_s = max(reaped, sum(sampler.cpu_s.values()))
    ours = run.cpu_s + time.process_time() - self_before
    run.foreign_cpu_s = max(0.0, _busy_cpu_s() - busy_before - ours)
    run.peak_rss_mb = sampler.peak_rss / 2**20
    run.peak_pss_mb = sampler.peak_pss / 2**20
    run.max_processes = sampler.max_processes
    run.log = str(log_path)


def arm_command(arm: str, clients: int, rounds: int, result: Path, run_dir: Path) -> list[str]:
    """The command line of one arm; arms on Ray run in a loopback-only namespace."""
    python = sys.executable
    if arm == "imports":
        return [python, "-c", IMPORTS_RUN]
    if arm in OURS:
        command = [
            python,
            "-c",
            COHORT_RUN if arm == "cohort" else WARM_RUN,
            *(["engine=flower-sim"] if arm in ON_RAY else []),
            f"engine.cohort={'auto' if arm.endswith('cohort') else 'off'}",
            "task=synthetic",
            "partition=natural",
            f"num_clients={clients}",
            f"clients_per_round={clients}",
            f"rounds={rounds}",
            f"local_epochs={LOCAL_EPOCHS}",
            f"batch_size={BATCH_SIZE}",
            f"task.hidden=[{','.join(map(str, HIDDEN))}]",
            f"task.options.dim={DIM}",
            f"task.options.num_classes={NUM_CLASSES}",
            f"task.options.samples_per_device={SAMPLES_PER_DEVICE}",
            f"+task.options.iid={str(IID).lower()}",
            "progress=false",
            "plots=false",
            f"checkpoint_every={rounds}",  # one checkpoint, after the timed rounds
            f"hydra.run.dir={run_dir}",
        ]
        return _in_netns(command) if arm in ON_RAY else command
    worker = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        arm,
        "--clients",
        str(clients),
        "--rounds",
        str(rounds),
        "--result",
        str(result),
    ]
    return _in_netns(worker) if arm in ON_RAY else worker


def _in_netns(command: list[str]) -> list[str]:
    """`command` in a loopback-only network namespace (Ray probes a public DNS address)."""
    quoted = " ".join(f"'{a}'" for a in command)
    return ["unshare", "-n", "sh", "-c", f"ip link set lo up; exec {quoted}"]


def compile_bytecode() -> None:
    """Write our packages' bytecode before any arm runs (`make bytecode` does the same): a
    one-time cost on a machine that writes .pyc, which PYTHONDONTWRITEBYTECODE (set in
    containers) would otherwise charge to every start of the fl-run arms and of `imports`."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        if not compileall.compile_dir(REPO / pattern.rstrip("*"), quiet=1):
            raise SystemExit(f"bench: {pattern.rstrip('*')}: compileall failed")


def run_arm(arm: str, repeat: int, args: argparse.Namespace, log_dir: Path) -> Run:
    """One measured run of `arm`, with its accuracy and in-process time read back."""
    scratch = Path(tempfile.mkdtemp(prefix=f"bench-{arm}-"))
    result, run_dir = scratch / "result.json", scratch / "run"
    run = Run(arm, repeat, arm_command(arm, args.clients, args.rounds, result, run_dir))
    env = {**os.environ, **OFFLINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["BENCH_MODULES"] = str(log_dir / "cohort_modules.json")  # the cohort's, for `imports`
    log_path = log_dir / f"{arm}_n{args.clients}_r{repeat}.log"
    run.waited_s = wait_for_quiet(args.quiet_wait)
    measure(run, env, log_path, args.timeout)
    if arm in OURS and (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
        run.accuracy, run.in_process_s = summary["final_accuracy"], summary["wall_time_s"]
    elif result.exists():
        found = json.loads(result.read_text())
        run.accuracy, run.in_process_s = found["accuracy"], found["in_process_s"]
    shutil.rmtree(scratch, ignore_errors=True)
    return run


# ----- report -------------------------------------------------------------------------------


def _succeeded(run: Run) -> bool:
    """Exited cleanly and, where the arm trains, reported its accuracy."""
    return run.returncode == 0 and (run.accuracy is not None or run.arm == "imports")


def summarize(runs: list[Run], flops: float, gflops: float) -> dict[str, dict[str, Any]]:
    """Per arm: medians and ranges over its successful repeats, and the fraction of the
    matmul ceiling (`gflops`) its training FLOPs (`flops`, all rounds) reach in its rounds."""
    out: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        ok = [r for r in runs if r.arm == arm and _succeeded(r)]
        if not ok:
            continue
        walls = [r.wall_s for r in ok]
        inproc = [r.in_process_s for r in ok if r.in_process_s is not None]
        median_inproc = statistics.median(inproc) if inproc else None
        accuracies = [r.accuracy for r in ok if r.accuracy is not None]
        out[arm] = {
            "runs": len(ok),
            "failed": sum(r.arm == arm for r in runs) - len(ok),
            "wall_s": statistics.median(walls),
            "wall_min_s": min(walls),
            "wall_max_s": max(walls),
            "in_process_s": median_inproc,
            "cpu_s": statistics.median(r.cpu_s for r in ok),
            "foreign_cpu_s": statistics.median(r.foreign_cpu_s for r in ok),
            "load1": statistics.median(r.load1 for r in ok),
            "peak_rss_mb": statistics.median(r.peak_rss_mb for r in ok),
            "peak_pss_mb": statistics.median(r.peak_pss_mb for r in ok),
            "processes": max(r.max_processes for r in ok),
            "accuracy": statistics.median(accuracies) if accuracies else None,
            "ceiling_fraction": flops / (median_inproc * gflops * 1e9) if median_inproc else None,
        }
    return out


def paired(runs: list[Run], arm: str, base: str, key: str) -> float | None:
    """Median over repeats of `arm`'s `key` / `base`'s in the same repeat (both succeeded)."""
    by = {(r.arm, r.repeat): r for r in runs if _succeeded(r)}
    ratios = [
        getattr(by[(arm, k)], key) / getattr(by[(base, k)], key)
        for (name, k) in by
        if name == arm
        and (base, k) in by
        and getattr(by[(arm, k)], key)
        and getattr(by[(base, k)], key)
    ]
    return statistics.median(ratios) if ratios else None


def table(summary: dict[str, dict[str, Any]]) -> str:
    """Markdown table of the summary (medians; ratios in `verdicts` are paired)."""
    lines = [
        "| arm | wall s, median (min–max) | in-process s | CPU s | other jobs' CPU s | load "
        "| peak RSS MB | peak PSS MB | processes | % of matmul ceiling (rounds) "
        "| test accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in summary.items():
        inproc = f"{s['in_process_s']:.2f}" if s["in_process_s"] is not None else "–"
        ceiling = f"{100 * s['ceiling_fraction']:.2f}" if s["ceiling_fraction"] else "–"
        failed = f" ({s['failed']} failed)" if s["failed"] else ""
        accuracy = f"{s['accuracy']:.4f}" if s["accuracy"] is not None else "–"
        lines.append(
            f"| {arm}{failed} | {s['wall_s']:.2f} ({s['wall_min_s']:.2f}–{s['wall_max_s']:.2f}) "
            f"| {inproc} | {s['cpu_s']:.1f} | {s['foreign_cpu_s']:.1f} | {s['load1']:.1f} "
            f"| {s['peak_rss_mb']:.0f} | {s['peak_pss_mb']:.0f} | {s['processes']} "
            f"| {ceiling} | {accuracy} |"
        )
    return "\n".join(lines)


def verdicts(summary: dict[str, dict[str, Any]], runs: list[Run]) -> list[str]:
    """Issue 37's goals, on paired ratios: cohort ≤ 0.12× plain's rounds (in-process),
    vanilla Flower ≥ 25× the cohort's CPU seconds, cohort peak RSS ≤ 1 GB; and the other
    arms' paired ratios for reference."""
    lines = []
    for arm, base, key, what in (
        ("cohort", "plain", "in_process_s", "in-process (rounds)"),
        ("cohort", "plain", "cpu_s", "CPU s (whole process)"),
        ("cohort", "plain", "wall_s", "wall (start-up included)"),
        ("ours", "plain", "in_process_s", "in-process (rounds)"),
        ("ours", "plain", "cpu_s", "CPU s (whole process)"),
        ("ours", "plain", "wall_s", "wall (start-up included)"),
    ):
        ratio = paired(runs, arm, base, key)
        if ratio is None:
            continue
        goal = ""
        if (arm, key) == ("cohort", "in_process_s"):
            goal = f" (goal ≤ {CHECK_GOALS['cohort_ratio']}×: "
            goal += f"{_ok(ratio <= CHECK_GOALS['cohort_ratio'])})"
        lines.append(f"{arm} / {base} {what}: {ratio:.3f}×, paired median{goal}")
    for slow, fast in (("flower", "cohort"), ("flower", "ours"), *_RAY_PAIRS):
        for key, what in (("cpu_s", "CPU s"), ("wall_s", "wall")):
            ratio = paired(runs, slow, fast, key)
            if ratio is None:
                continue
            goal = ""
            if (slow, fast, key) == ("flower", "cohort", "cpu_s"):
                goal = f" (goal ≥ {CHECK_GOALS['flower_cpu']}×: "
                goal += f"{_ok(ratio >= CHECK_GOALS['flower_cpu'])})"
            lines.append(
                f"{slow} / {fast} {what}: {ratio:.1f}×, paired median "
                f"(Flower: run_simulation with 2 Ray actors){goal}"
            )
    floor = paired(runs, "imports", "cohort", "cpu_s")
    if floor is not None:
        lines.append(
            f"imports / cohort CPU s: {floor:.2f}×, paired median (the cohort run's modules "
            "imported and nothing run: the floor of any run of this process)"
        )
    bound = paired(runs, "flower", "imports", "cpu_s")
    if bound is not None:
        lines.append(
            f"flower / imports CPU s: {bound:.1f}×, paired median (the most any run of this "
            f"process could reach on the ≥ {CHECK_GOALS['flower_cpu']}× goal)"
        )
    for arm in ("cohort", "ours"):
        if arm in summary:
            rss = summary[arm]["peak_rss_mb"]
            lines.append(
                f"{arm} peak RSS: {rss:.0f} MB "
                f"(goal ≤ {CHECK_GOALS['rss_mb']:.0f} MB: {_ok(rss <= CHECK_GOALS['rss_mb'])})"
            )
    return lines


_RAY_PAIRS = (("sim", "flower"), ("sim_cohort", "flower"), ("sim", "sim_cohort"))


def matmul_gflops(size: int = 1024, repeats: int = 5) -> float:
    """The ceiling: GFLOP/s of one single-threaded float32 matmul (MKL), best of `repeats`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every arm
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    torch.set_num_threads(threads)
    return 2 * size**3 / best / 1e9


def training_flops(clients: int, rounds: int) -> float:
    """FLOPs of every round's training: 6 per multiply-add of the MLP per trained sample
    (2 forward, 4 backward), evaluation and optimizer updates left out."""
    data, parts = workload(clients)
    del data
    widths = (DIM, *HIDDEN, NUM_CLASSES)
    macs = sum(a * b for a, b in itertools.pairwise(widths))
    samples = sum(len(p) for p in parts) * LOCAL_EPOCHS
    return 6.0 * macs * samples * rounds


def _ok(passed: bool) -> str:
    return "met" if passed else "MISSED"


def git_state() -> str:
    """HEAD's short hash, with '+dirty' when tracked files differ from it."""

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


# ----- entry point --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(ARMS)}"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "experiments/out/bench_many_clients.json"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        help="before each run, wait up to this many seconds for other jobs to leave the CPUs",
    )
    parser.add_argument("--worker", choices=("plain", "flower"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    if "imports" in args.arms.split(",") and "cohort" not in args.arms.split(","):
        parser.error("the imports arm replays the cohort arm's imports: add --arms cohort")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        # Imported by name (not __main__) so Ray actors can unpickle the ClientApp by reference.
        sys.path.insert(0, str(REPO))
        bench = importlib.import_module("experiments.bench_many_clients")
        worker = bench.plain_worker if args.worker == "plain" else bench.flower_worker
        worker(args.clients, args.rounds, args.result)
        return
    # Orphaned Ray daemons re-parent to us, so the tree we sample and reap holds them all.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    arms = [a for a in ARMS if a in args.arms.split(",")]
    git = git_state()  # at launch: other work may commit while the benchmark runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.with_suffix(".logs")
    log_dir.mkdir(exist_ok=True)
    compile_bytecode()
    load_start = os.getloadavg()
    gflops, flops = matmul_gflops(), training_flops(args.clients, args.rounds)
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for arm in arms:  # interleaved, so drift of the machine hits every arm alike
            run = run_arm(arm, repeat, args, log_dir)
            runs.append(run)
            acc = f"{run.accuracy:.4f}" if run.accuracy is not None else "n/a"
            print(
                f"[{repeat}] {arm:6s} rc={run.returncode} wall={run.wall_s:7.2f}s "
                f"rss={run.peak_rss_mb:6.0f}MB pss={run.peak_pss_mb:6.0f}MB "
                f"cpu={run.cpu_s:6.1f}s procs={run.max_processes} lingering={run.lingering} "
                f"load={run.load1:.1f} foreign_cpu={run.foreign_cpu_s:.1f}s "
                f"waited={run.waited_s:.0f}s acc={acc}",
                flush=True,
            )
    summary = summarize(runs, flops, gflops)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": os.cpu_count(),
        "git": git,
        "clients": args.clients,
        "rounds": args.rounds,
        "matmul_gflops": gflops,
        "training_flops": flops,
        "load_avg_start_end": [load_start, os.getloadavg()],
        "summary": summary,
        "runs": [asdict(r) for r in runs],
    }
    write_atomic(args.out, json.dumps(report, indent=2) + "\n")
    print()
    print(table(summary))
    print()
    for line in verdicts(summary, runs):
        print(line)
    print(
        f"ceiling: one single-threaded matmul at {gflops:.1f} GFLOP/s; training "
        f"{flops / 1e6:.0f} MFLOP over {args.rounds} rounds; load (1, 5, 15 min) at start "
        f"{load_start}, at end {os.getloadavg()}"
    )
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
