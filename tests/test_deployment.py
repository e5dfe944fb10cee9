"""engine=deployment: a real SuperLink and two SuperNodes on 127.0.0.1, runs via `fl-run`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from conftest import OFFLINE, REPO, fl_env, fl_run_cmd, read_metrics, run_fl
from omegaconf import OmegaConf

from fl.engines.deployment import (
    CONNECTION,
    flower_connection,
    flower_home,
    server_overrides,
)

BIN = Path(sys.executable).parent
RUN = ["num_clients=2", "clients_per_round=2", "rounds=2", "task=digits", "local_epochs=1"]
DENSE_BYTES = 2 * 4810 * 4  # 2 clients x MLP 64-64-10 (4,810 float32 parameters), each way


def _free_ports(n: int) -> list[int]:
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


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process we started and everything below it, then SIGKILL leftovers.

    Each of ours leads its own session; the SuperExecs they spawn detach into sessions of
    their own, so those are found through the process tree, by pid, before anything dies.
    """
    tree: list[psutil.Process] = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += psutil.Process(proc.pid).children(recursive=True)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(
        [*tree, *(psutil.Process(p.pid) for p in procs if p.poll() is None)], timeout=10
    )
    for leftover in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()
    for proc in procs:
        proc.wait(timeout=10)


@dataclass
class Federation:
    """A running SuperLink (its one HTTP port serves Fleet, Control and Runtime APIs)."""

    port: int
    root: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def logs(self) -> str:
        return "".join(
            f"\n--- {p.name} ---\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log"))
        )


def _start(cmd: list[str], log: Path, home: Path) -> subprocess.Popen[bytes]:
    # Each process gets its own FLWR_HOME (FABs are installed there) and session (killpg);
    # the venv's bin goes first on PATH because they spawn flower-superexec, flwr-*app by name.
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**fl_env(), **OFFLINE, "FLWR_HOME": str(home), "PATH": path}
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


@contextlib.contextmanager
def running_federation(root: Path, nodes: int = 2) -> Iterator[Federation]:
    """An insecure SuperLink and `nodes` SuperNodes (partition i of `nodes`) on 127.0.0.1."""
    link_port, *node_ports = _free_ports(1 + nodes)
    fed = Federation(link_port, root)
    try:
        home = root / "superlink"
        home.mkdir()
        link = _start(
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--database",
                str(root / "state.db"),
                "--host",
                "127.0.0.1",
                "--port",
                str(link_port),
            ],
            root / "superlink.log",
            home,
        )
        fed.procs.append(link)
        _wait_listening(link_port, link)
        for pid, node_port in enumerate(node_ports):
            home = root / f"supernode{pid}"
            home.mkdir()
            fed.procs.append(
                _start(
                    [
                        str(BIN / "flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{link_port}",
                        "--port",  # the node's own Runtime API; one port per node
                        str(node_port),
                        "--node-config",
                        f"partition-id={pid} num-partitions={nodes}",
                    ],
                    root / f"supernode{pid}.log",
                    home,
                )
            )
        yield fed
    finally:
        _stop(fed.procs)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    with running_federation(tmp_path_factory.mktemp("federation")) as fed:
        yield fed


def _submit(fed: Federation, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
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
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        _stop([proc])
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.integration
def test_deployment_runs_two_rounds_like_the_local_engine(federation, tmp_path):
    proc = _submit(federation, tmp_path / "dep", *RUN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + federation.logs()
    assert "completed" in proc.stdout
    dep = read_metrics(tmp_path / "dep")
    assert [r["round"] for r in dep] == [1, 2]
    assert dep[0]["accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert dep[1]["accuracy"] > dep[0]["accuracy"]
    assert all(r["bytes_up"] == r["bytes_down"] == DENSE_BYTES for r in dep)
    assert all(r["replies"] == 2 and r["failed"] == 0 for r in dep)
    assert (tmp_path / "dep" / "summary.json").exists()

    # Same partitions (from --node-config), same seeds, full participation: same numbers.
    run_fl(tmp_path / "local", *RUN, "engine=local")
    local = read_metrics(tmp_path / "local")
    for key in ("accuracy", "loss", "bytes_up", "bytes_down", "virtual_time_s"):
        assert [r[key] for r in dep] == [r[key] for r in local], key


@pytest.mark.integration
def test_deployment_exits_nonzero_when_the_run_fails(federation, tmp_path):
    # resume=true without a checkpoint: the ServerApp raises on the SuperLink's side,
    # `flwr run --stream` itself still exits 0, and fl-run must notice.
    proc = _submit(federation, tmp_path, *RUN, "rounds=1", "resume=true")
    assert proc.returncode != 0
    assert "ended as finished:failed" in proc.stderr
    assert "no checkpoint at" in proc.stderr


# ----- the submission itself, without a SuperLink -------------------------------------------


def test_server_overrides_pin_an_absolute_output_dir():
    user = ["strategy=fedprox", "rounds=5", "output_dir=/elsewhere", "+extra.key=1"]
    assert (
        server_overrides(user, "/srv/out")
        == "strategy=fedprox rounds=5 +extra.key=1 output_dir=/srv/out"
    )
    with pytest.raises(SystemExit, match="absolute"):
        server_overrides(["rounds=5"], "outputs/x")
    with pytest.raises(SystemExit, match="whitespace"):
        server_overrides(["task.hidden=[64, 64]"], "/srv/out")


def test_flower_connection_follows_engine_tls_settings(tmp_path):
    engine = {"superlink": "10.0.0.5:8000", "insecure": True, "root_certificates": None}
    assert flower_connection(OmegaConf.create({"engine": engine})) == {
        "address": "10.0.0.5:8000",
        "insecure": True,
    }
    tls = {**engine, "insecure": False, "root_certificates": str(tmp_path / "ca.pem")}
    assert flower_connection(OmegaConf.create({"engine": tls})) == {
        "address": "10.0.0.5:8000",
        "root-certificates": str(tmp_path / "ca.pem"),
    }


def test_a_user_flwr_home_keeps_its_connections(tmp_path, monkeypatch):
    (tmp_path / "config.toml").write_text(
        '[superlink]\ndefault = "mine"\n[superlink.mine]\naddress = "1.2.3.4:8000"\n'
    )
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    engine = {"superlink": "127.0.0.1:8000", "insecure": True, "root_certificates": None}
    with flower_home(OmegaConf.create({"engine": engine})) as home:
        assert home == tmp_path
    config = tomllib.loads((tmp_path / "config.toml").read_text())
    assert config["superlink"]["default"] == "mine"
    assert config["superlink"]["mine"] == {"address": "1.2.3.4:8000"}
    assert config["superlink"][CONNECTION] == {"address": "127.0.0.1:8000", "insecure": True}


def test_without_flwr_home_a_private_one_is_used_and_removed(monkeypatch):
    monkeypatch.delenv("FLWR_HOME", raising=False)
    engine = {"superlink": "127.0.0.1:8000", "insecure": True, "root_certificates": None}
    with flower_home(OmegaConf.create({"engine": engine})) as home:
        assert home != Path.home() / ".flwr"
        assert tomllib.loads((home / "config.toml").read_text())["superlink"][CONNECTION]
    assert not home.exists()
