"""Test support: a real SuperLink and SuperNodes on 127.0.0.1, and `fl-run` submitting to them.

Used by every integration test of `engine=deployment` (plain, killed node, edge node,
TLS with node authentication, outsiders). Each process gets its own log (`ROOT/NAME.log`),
its own FLWR_HOME (`ROOT/NAME/`, where it installs the FAB) and its own session, so
`stop()` ends exactly what the test started. A federation may run inside a network
namespace (`wrap`, see `netns_pair`), with `fl.net.gate` as the only way in from outside.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
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
import pytest
import tomli_w
from conftest import OFFLINE, REPO, fl_env, fl_run_cmd, read_metrics, run_fl

from fl.run.engines.deployment import app_files

__all__ = [
    "BIN",
    "TWO_ROUNDS",
    "Federation",
    "Wrap",
    "app_copy",
    "flwr_cli",
    "local_rows",
    "netns_pair",
    "running_federation",
    "stop_processes",
    "submit",
]

Wrap = Callable[[list[str]], list[str]]  # e.g. run a command in a network namespace

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


def _connects(host: str, port: int, wrap: Wrap | None) -> bool:
    if wrap is None:
        with socket.socket() as s:
            return s.connect_ex((host, port)) == 0
    probe = wrap(["bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"])  # from inside `wrap`
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def _wait_listening(
    port: int,
    proc: subprocess.Popen[bytes],
    timeout: float = 60,
    host: str = "127.0.0.1",
    wrap: Wrap | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        if _connects(host, port, wrap):
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


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
    """A SuperLink (its one HTTP port serves Fleet, Control and Runtime APIs) and nodes.

    With `wrap`, every process runs through it (in a network namespace, say). SuperNodes
    dial `fleet`: the SuperLink itself, or the Fleet-only gate once `start_gate` ran.
    """

    root: Path
    port: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    wrap: Wrap | None = None
    fleet: str = ""
    _ports: Iterator[int] = field(default_factory=lambda: iter(_free_ports(PORTS)))

    def start(self, name: str, cmd: list[str], wrap: Wrap | None = None) -> subprocess.Popen[bytes]:
        """Start `cmd` with its own FLWR_HOME, log and session; stopped by `stop()`.

        It runs through `wrap`, else through the federation's own `wrap`.
        """
        home = self.root / name
        home.mkdir(parents=True)
        # The venv's bin goes first on PATH: SuperLinks and SuperNodes spawn
        # flower-superexec, flwr-serverapp and flwr-clientapp by name.
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {**fl_env(), **OFFLINE, "FLWR_HOME": str(home), "PATH": path}
        wrap = wrap or self.wrap
        with (self.root / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                wrap(cmd) if wrap else cmd,
                cwd=home,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def start_superlink(self, *flags: str) -> None:
        """A SuperLink with these flags (`--insecure`, or TLS ones); returns once it listens."""
        self.port = next(self._ports)
        cmd = [str(BIN / "flower-superlink"), *flags, "--database", str(self.root / "state.db")]
        link = self.start("superlink", [*cmd, "--host", "127.0.0.1", "--port", str(self.port)])
        self.fleet = f"127.0.0.1:{self.port}"
        _wait_listening(self.port, link, wrap=self.wrap)

    def start_gate(self, host: str, *flags: str) -> None:
        """`python -m fl.net.gate` on `host` in front of the SuperLink; nodes dial it from now on.

        `flags`: the gate's TLS flags (as the SuperLink's), or `--insecure`.
        """
        port = next(self._ports)
        cmd = [sys.executable, "-m", "fl.net.gate", "--listen", f"{host}:{port}"]
        gate = self.start("gate", [*cmd, "--superlink", f"127.0.0.1:{self.port}", *flags])
        self.fleet = f"{host}:{port}"
        _wait_listening(port, gate, host=host, wrap=self.wrap)

    def flwr(
        self, *args: str, ca: Path | None, address: str = "", name: str = "cli"
    ) -> subprocess.CompletedProcess[str]:
        """The `flwr` CLI against `address` (the SuperLink's Control API by default)."""
        home = self.root / name
        return flwr_cli(home, address or f"127.0.0.1:{self.port}", ca, *args, wrap=self.wrap)

    def start_supernode(
        self,
        partition: int,
        partitions: int,
        *flags: str,
        name: str | None = None,
        wrap: Wrap | None = None,
        node_config: str = "",
    ) -> subprocess.Popen[bytes]:
        """A SuperNode holding `partition` of `partitions`, dialling `fleet`; `node_config`:
        more `--node-config` pairs in Flower's syntax (strings quoted: `key="a,b"`)."""
        cmd = [
            str(BIN / "flower-supernode"),
            *flags,
            "--superlink",
            self.fleet,
            "--port",  # the node's own Runtime API; one port per node
            str(next(self._ports)),
            "--node-config",
            f"partition-id={partition} num-partitions={partitions} {node_config}".strip(),
        ]
        return self.start(name or f"supernode{partition}", cmd, wrap)

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


def flwr_cli(
    home: Path, address: str, ca: Path | None, *args: str, wrap: Wrap | None = None
) -> subprocess.CompletedProcess[str]:
    """`flwr ARGS link` with FLWR_HOME=`home`, whose connection `link` is `address`,
    trusting `ca` (None: no CA of its own, so only the system's)."""
    home.mkdir(parents=True, exist_ok=True)
    conn = {"address": address}
    if ca is not None:
        conn["root-certificates"] = str(ca)
    (home / "config.toml").write_text(
        tomli_w.dumps({"superlink": {"default": "link", "link": conn}})
    )
    cmd = [str(BIN / "flwr"), *args, "link"]
    return subprocess.run(
        wrap(cmd) if wrap else cmd,
        env={**fl_env(), **OFFLINE, "FLWR_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@contextlib.contextmanager
def netns_pair(subnet: int = 77) -> Iterator[tuple[Wrap, str, Wrap, str]]:
    """Two fresh network namespaces joined by a veth pair, nothing else in either.

    Yields (wrap_a, address_a, wrap_b, address_b): `wrap_x(cmd)` runs `cmd` in namespace x,
    which has loopback and 10.213.`subnet`.1 (a) or .2 (b). Needs root and iproute2
    (skips otherwise); the namespaces, and with them the veth pair, are deleted afterwards.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for `ip netns`")
    names = (f"fl-a{os.getpid()}", f"fl-b{os.getpid()}")
    addresses = (f"10.213.{subnet}.1", f"10.213.{subnet}.2")

    def wrapper(ns: str) -> Wrap:
        return lambda cmd: ["ip", "netns", "exec", ns, *cmd]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    try:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # stale
            try:
                ip("netns", "add", ns)
            except subprocess.CalledProcessError as err:
                pytest.skip(f"cannot create a network namespace: {err.stderr.decode().strip()}")
            ip("-n", ns, "link", "set", "lo", "up")
        # Created inside namespace a with its peer inside b: no interface ever in ours.
        veth = ["link", "add", "fl-va", "type", "veth", "peer", "name", "fl-vb", "netns"]
        ip("-n", names[0], *veth, names[1])
        for ns, dev, address in zip(names, ("fl-va", "fl-vb"), addresses, strict=True):
            ip("-n", ns, "addr", "add", f"{address}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
        yield wrapper(names[0]), addresses[0], wrapper(names[1]), addresses[1]
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def app_copy(dest: Path, clientapp: str) -> Path:
    """A copy of this repo's App (every file `.gitignore` keeps, as they are now) whose
    `pyproject.toml` names `clientapp` as its ClientApp component; `dest` returned.

    `python -m fl.run` run inside it submits the copy (fl-run packs the FAB from the
    checkout its `fl` package comes from): the App a user edits in DEPLOYMENT.md §15.
    """
    for name in app_files(REPO):  # what fl-run stages for `flwr run`
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    pyproject = dest / "pyproject.toml"
    default = 'clientapp = "clients.app:app"'
    text = pyproject.read_text()
    assert default in text, "pyproject.toml no longer names clients.app:app"
    pyproject.write_text(text.replace(default, f'clientapp = "{clientapp}"'))
    return dest


def submit(
    fed: Federation, run_dir: Path, *overrides: str, timeout: float = 240, app: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """`fl-run engine=deployment` against `fed` (through its `wrap`), to the end of the run;
    `app`: the checkout it runs in, and so the App it submits (see `app_copy`)."""
    cmd = fl_run_cmd(
        f"hydra.run.dir={run_dir}",
        "engine=deployment",
        f"engine.superlink=127.0.0.1:{fed.port}",
        *overrides,
    )
    # No FLWR_HOME: fl-run must write its connection into a private one.
    env = {k: v for k, v in {**fl_env(), **OFFLINE}.items() if k != "FLWR_HOME"}
    proc = subprocess.Popen(
        fed.wrap(cmd) if fed.wrap else cmd,
        cwd=app,
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
