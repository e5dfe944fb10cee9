"""An edge-class SuperNode: half a CPU core and 1.5 GiB, set with cgroup v1, still trains.

The SuperNode of partition 0 starts inside a fresh cpu and memory cgroup
(`cpu.cfs_quota_us` 50 000 of 100 000, `memory.limit_in_bytes` 1.5 GiB); the
SuperExec and every `flwr-clientapp` it spawns inherit the group, as on a device whose
whole budget is that small. The other SuperNode is unconstrained. Also here: the
client side runs without the server-only packages (the lean edge install), and the
device choice (`device=auto|cpu|cuda`, one GPU per SuperNode, a memory share per process).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, fl_env, read_metrics
from federation import TWO_ROUNDS, Federation, local_rows, submit

from fl.world import task

CGROUP = Path("/sys/fs/cgroup")
CPU_QUOTA_US, CPU_PERIOD_US = 50_000, 100_000  # half a core
MEMORY_LIMIT = 1536 * 2**20  # a 2 GB board minus what its OS keeps


@dataclass
class EdgeGroup:
    """A cpu + memory cgroup pair, and what was seen running in it."""

    name: str
    seen: set[str] = field(default_factory=set)

    def path(self, controller: str) -> Path:
        return CGROUP / controller / self.name

    def read(self, controller: str, key: str) -> str:
        return (self.path(controller) / key).read_text()

    def stat(self, controller: str, key: str) -> dict[str, int]:
        lines = self.read(controller, key).split("\n")
        return {k: int(v) for k, v in (line.split() for line in lines if line)}

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run by a shell that first moves itself into both groups."""
        join = " && ".join(f"echo $$ > {self.path(c) / 'cgroup.procs'}" for c in ("cpu", "memory"))
        return ["sh", "-c", f'{join} && exec "$@"', "sh", *cmd]

    def pids(self) -> list[int]:
        text = self.read("memory", "cgroup.procs")
        return [int(p) for p in text.split()]

    def watch(self, stop: threading.Event) -> None:
        """Record the programs running in the group until `stop` is set."""
        while not stop.wait(0.3):
            for pid in self.pids():
                with contextlib.suppress(psutil.Error):
                    self.seen.update(Path(arg).name for arg in psutil.Process(pid).cmdline()[:2])


def _make_group() -> EdgeGroup:
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    for controller, knob in (("cpu", "cpu.cfs_quota_us"), ("memory", "memory.limit_in_bytes")):
        if not (CGROUP / controller / knob).exists():
            pytest.skip(f"no cgroup v1 {controller} controller at {CGROUP / controller}")
    group = EdgeGroup(f"fl-edge-{uuid.uuid4().hex[:8]}")
    try:
        for controller in ("cpu", "memory"):
            group.path(controller).mkdir()
        (group.path("cpu") / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (group.path("cpu") / "cpu.cfs_quota_us").write_text(str(CPU_QUOTA_US))
        (group.path("memory") / "memory.limit_in_bytes").write_text(str(MEMORY_LIMIT))
    except OSError as err:
        _remove_group(group)
        pytest.skip(f"cannot create cgroups: {err}")
    return group


def _remove_group(group: EdgeGroup) -> None:
    for controller in ("cpu", "memory"):
        path = group.path(controller)
        if not path.exists():
            continue
        for pid in (path / "cgroup.procs").read_text().split():  # stragglers: back to root
            with contextlib.suppress(OSError):
                (CGROUP / controller / "cgroup.procs").write_text(pid)
        path.rmdir()


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Federation, EdgeGroup]]:
    group = _make_group()
    fed = Federation(tmp_path_factory.mktemp("edge"))
    try:
        fed.start_superlink("--insecure")
        fed.start_supernode(0, 2, "--insecure", wrap=group.wrap)  # the edge device
        fed.start_supernode(1, 2, "--insecure")
        yield fed, group
    finally:
        fed.stop()
        _remove_group(group)


@pytest.mark.slow  # about 80 s: a full deployment at half a core
@pytest.mark.integration
def test_a_supernode_at_half_a_core_and_1_5_gib_completes_rounds(edge, tmp_path):
    fed, group = edge
    stop = threading.Event()
    watcher = threading.Thread(target=group.watch, args=(stop,), daemon=True)
    watcher.start()
    try:
        proc = submit(fed, tmp_path / "dep", *TWO_ROUNDS)
    finally:
        stop.set()
        watcher.join()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + fed.logs()
    rows = read_metrics(tmp_path / "dep")
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["replies"] == 2 and r["failed"] == 0 for r in rows)

    # The limits held the node and everything it spawned.
    assert {"flower-supernode", "flower-superexec", "flwr-clientapp"} <= group.seen, group.seen
    peak = int(group.read("memory", "memory.max_usage_in_bytes"))
    assert 300 * 2**20 < peak <= MEMORY_LIMIT  # torch was imported inside the group
    oom = group.stat("memory", "memory.oom_control")
    assert oom.get("oom_kill", 0) == 0
    cpu = group.stat("cpu", "cpu.stat")
    assert cpu["nr_throttled"] > 0  # the quota bit
    print(
        f"edge node: peak {peak / 2**20:.0f} MiB of {MEMORY_LIMIT / 2**20:.0f} MiB, "
        f"throttled in {cpu['nr_throttled']} of {cpu['nr_periods']} periods "
        f"({cpu['throttled_time'] / 1e9:.1f} s)"
    )

    # Constrained, not changed: the same numbers as the local engine.
    local = local_rows(*TWO_ROUNDS)
    for key in ("accuracy", "loss", "bytes_up", "bytes_down"):
        assert [r[key] for r in rows] == [r[key] for r in local], key


# ----- the lean client install ---------------------------------------------------------------

SERVER_ONLY = ("ray", "matplotlib", "tqdm", "wandb", "torchvision", "opacus")
ONE_ROUND = """
from flwr.app import ArrayRecord, ConfigRecord

from clients.app import app
from fl.common.config import compose, to_run_config
from fl.run.engines.local import LocalGrid
from fl.strategy.registry import get_strategy
from fl.world.task import get_task

cfg = compose(["num_clients=2", "clients_per_round=2", "local_epochs=1"])
grid = LocalGrid(app, 2, to_run_config(cfg))
spec = get_strategy("fedavg")
server = spec.server(spec.make_params({"name": "fedavg"}), seed=0, clients_per_round=2)
initial = ArrayRecord(get_task(cfg).new_model().state_dict())
replies = list(grid.send_and_receive(server.configure_train(1, initial, ConfigRecord(), grid)))
assert not [r.error.reason for r in replies if r.has_error()], replies
server.aggregate_train(1, replies)
assert server.stats.accepted == 2, server.stats
"""


def test_the_client_trains_without_server_only_packages(tmp_path):
    # Each package shadowed by one that fails to import, as if it were not installed.
    for name in SERVER_ONLY:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name}'!r}, name={name!r})\n"
        )
    env = {**fl_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    proc = subprocess.run(
        [sys.executable, "-c", ONE_ROUND],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# ----- clients' device: GPU when present, a share of it when several processes share one -----


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """Pretend a CUDA device is visible; record memory caps instead of setting them."""
    capped: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d))
    )
    task._cap_gpu_memory.cache_clear()
    yield capped
    task._cap_gpu_memory.cache_clear()


def test_auto_picks_the_gpu_and_caps_its_share(fake_gpu, monkeypatch):
    monkeypatch.setenv(task.GPU_MEMORY_FRACTION, "0.25")
    assert task.resolve_device("auto") == torch.device("cuda")
    assert task.resolve_device("cuda") == torch.device("cuda")
    assert fake_gpu == [(0.25, 0)]  # once per process
    assert task.resolve_device("cpu") == torch.device("cpu")


def test_without_a_fraction_the_allocator_is_left_alone(fake_gpu, monkeypatch):
    monkeypatch.delenv(task.GPU_MEMORY_FRACTION, raising=False)
    assert task.resolve_device("auto") == torch.device("cuda")
    assert fake_gpu == []


@pytest.mark.parametrize("bad", ["0", "1.5", "half", "-0.1"])
def test_a_bad_fraction_fails_clearly(fake_gpu, monkeypatch, bad):
    monkeypatch.setenv(task.GPU_MEMORY_FRACTION, bad)
    with pytest.raises(ValueError, match="FL_GPU_MEMORY_FRACTION"):
        task.resolve_device("cuda")


def test_cpu_only_machines_run_unchanged(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(task.GPU_MEMORY_FRACTION, "0.5")  # ignored without a GPU
    assert task.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        task.resolve_device("cuda")
