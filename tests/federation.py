"""Test support: a real SuperLink and SuperNodes on 127.0.0.1, and `fl-run` submitting to them.

Used by every integration test of `engine=deployment` (plain, killed node, edge node,
TLS with node authentication). Each process gets its own log (`ROOT/NAME.log`), its own
FLWR_HOME (`ROOT/NAME/`, where it installs the FAB) and its own session, so `stop()`
ends exactly what the test started.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from conftest import OFFLINE, REPO, fl_env, fl_run_cmd, read_metrics, run_fl

__all__ = [
    "BIN",
    "TWO_ROUNDS",
    "Federation",
    "local_rows",
    "running_federation",
    "stop_processes",
    "submit",
]

BIN = Path(sys.executable).parent
# Two SuperNodes, full participation (digits, the default task): the run of section 8 of
# docs/DEPLOYMENT.md, which `engine=local` must reproduce bit for bit.
TWO_ROUNDS = ("num_clients=2", "clients_per_round=2", "rounds=2")
PORTS = 8  # per federation: a SuperLink, its SuperNodes' Runtime APIs, intruders


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def stop_processes(pids: Iterable[int]) -> None:
    """SIGTERM these session leaders, their sessions and everything below them; then
    SIGKILL leftovers.

    The SuperExecs that SuperLinks and SuperNodes spawn detach into sessions of their
    own, so they are found through the process tree, by pid, before anything dies.
    """
    roots = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            roots.append(psutil.Process(pid))
    tree = list(roots)
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += root.children(recursive=True)
    for root in roots:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, signal.SIGTERM)
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(tree, timeout=10)
    for leftover in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()
    psutil.wait_procs(alive, timeout=10)


@dataclass
class Federation:
    """A SuperLink (its one HTTP port serves Fleet, Control and Runtime APIs) and nodes."""

    root: Path
    port: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _ports: Iterator[int] = field(default_factory=lambda: iter(_free_ports(PORTS)))

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        """Start `cmd` with its own FLWR_HOME, log and session; stopped by `stop()`."""
        home = self.root / name
        home.mkdir(parents=True)
        # The venv's bin goes first on PATH: SuperLinks and SuperNodes spawn
        # flower-superexec, flwr-serverapp and flwr-clientapp by name.
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {**fl_env(), **OFFLINE, "FLWR_HOME": str(home), "PATH": path}
        with (self.root / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                cmd, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def start_superlink(self, *flags: str) -> None:
        """A SuperLink with these flags (`--insecure`, or TLS ones); returns once it listens."""
        self.port = next(self._ports)
        cmd = [str(BIN / "flower-superlink"), *flags, "--database", str(self.root / "state.db")]
        link = self.start("superlink", [*cmd, "--host", "127.0.0.1", "--port", str(self.port)])
        _wait_listening(self.port, link)

    def start_supernode(
        self,
        partition: int,
        partitions: int,
        *flags: str,
        name: str | None = None,
        wrap: Callable[[list[str]], list[str]] | None = None,
    ) -> subprocess.Popen[bytes]:
        """A SuperNode holding `partition` of `partitions`, dialling our SuperLink."""
        cmd = [
            str(BIN / "flower-supernode"),
            *flags,
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--port",  # the node's own Runtime API; one port per node
            str(next(self._ports)),
            "--node-config",
            f"partition-id={partition} num-partitions={partitions}",
        ]
        return self.start(name or f"supernode{partition}", wrap(cmd) if wrap else cmd)

    def logs(self) -> str:
        """The tail of every process's log, for assertion messages."""
        return "".join(
            f"\n--- {p.name} ---\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        stop_processes(p.pid for p in self.procs)
        for proc in self.procs:
            proc.wait(timeout=10)


@contextlib.contextmanager
def running_federation(root: Path, nodes: int = 2) -> Iterator[Federation]:
    """An insecure SuperLink and `nodes` SuperNodes (partition i of `nodes`) on 127.0.0.1."""
    fed = Federation(root)
    try:
        fed.start_superlink("--insecure")
        for partition in range(nodes):
            fed.start_supernode(partition, nodes, "--insecure")
        yield fed
    finally:
        fed.stop()


def submit(
    fed: Federation, run_dir: Path, *overrides: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """`fl-run engine=deployment` against `fed`, to the end of the run."""
    cmd = fl_run_cmd(
        f"hydra.run.dir={run_dir}",
        "engine=deployment",
        f"engine.superlink=127.0.0.1:{fed.port}",
        *overrides,
    )
    # No FLWR_HOME: fl-run must write its connection into a private one.
    env = {k: v for k, v in {**fl_env(), **OFFLINE}.items() if k != "FLWR_HOME"}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_processes([proc.pid])
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@functools.cache
def local_rows(*overrides: str) -> tuple[dict[str, Any], ...]:
    """metrics.jsonl of `fl-run engine=local` with these overrides (run once per session)."""
    with tempfile.TemporaryDirectory(prefix="fl-local-") as tmp:
        run_fl(Path(tmp), *overrides, "engine=local")
        return tuple(read_metrics(Path(tmp)))
