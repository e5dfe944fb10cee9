"""Flower's own entry points: `flwr run .` on Flower's default federation, and the
one-machine trial of docs/DEPLOYMENT.md run verbatim.

Both start SuperLinks on Flower's fixed ports (39091 and 8000), so they run in a
loopback-only network namespace, with HOME in the test's temporary directory: what
Flower writes under `~/.flwr` is checked there, never in the real home.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import OFFLINE, REPO, fl_env, read_metrics
from federation import BIN, TWO_ROUNDS, local_rows, stop_processes
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.superlink.grid import InMemoryGrid
from netns import in_netns, require_netns
from omegaconf import OmegaConf

from fl.run.engines.local import LocalGrid
from server.nodes import (
    NODE_WAIT_S,
    FederationError,
    discover_partitions,
    node_wait_s,
    wait_for_nodes,
)

DOC = REPO / "docs" / "DEPLOYMENT.md"
DENSE_BYTES = 2 * 4810 * 4  # 2 clients x MLP 64-64-10 (4,810 float32 parameters), each way


# ----- waiting for nodes and mapping partitions, without Flower's processes ------------------


def _grid(reported: list[int]) -> LocalGrid:
    """A grid of len(reported) nodes; node i says it holds partition reported[i]."""
    app = ClientApp()

    @app.query("info")
    def info(msg: Message, context: Context) -> Message:
        held = reported[int(context.node_config["partition-id"])]
        return Message(RecordDict({"info": ConfigRecord({"partition-id": held})}), reply_to=msg)

    return LocalGrid(app, len(reported), {})


class _Simulation(InMemoryGrid):
    """Flower's simulation grid, as its ServerApp sees it: a fixed set of nodes."""

    def __init__(self, nodes: int) -> None:  # no LinkState: only get_node_ids is used
        self.nodes = list(range(1, nodes + 1))

    def get_node_ids(self) -> list[int]:
        return self.nodes


def test_a_deployment_short_of_nodes_fails_after_the_wait():
    start = time.monotonic()
    with pytest.raises(FederationError, match=r"only 2 of 3 nodes connected after 0\.5 s"):
        wait_for_nodes(_grid([0, 1]), 3, wait_s=0.5)
    assert time.monotonic() - start < 5


def test_a_simulation_short_of_nodes_fails_once_its_node_count_settles():
    start = time.monotonic()
    with pytest.raises(FederationError, match="has 2 SuperNodes but num_clients=20"):
        wait_for_nodes(_Simulation(2), 20, wait_s=NODE_WAIT_S)
    assert time.monotonic() - start < 10  # not the node wait


def test_enough_nodes_need_no_wait():
    start = time.monotonic()
    assert len(wait_for_nodes(_Simulation(3), 3, wait_s=NODE_WAIT_S)) == 3
    assert time.monotonic() - start < 1


def test_every_partition_needs_exactly_one_node():
    grid = _grid([2, 0, 1, 7])  # partition 7 is outside num_clients=3: left out
    assert sorted(discover_partitions(grid, 3).values()) == [0, 1, 2]
    with pytest.raises(FederationError, match=r"several nodes: \[0\], by none: \[2\]"):
        discover_partitions(_grid([0, 1, 0]), 3)


def test_the_node_wait_comes_from_the_deployment_engine_or_the_default():
    deployment = OmegaConf.create({"engine": {"name": "deployment", "node_wait_s": 5}})
    assert node_wait_s(deployment) == 5.0
    assert node_wait_s(OmegaConf.create({"engine": {"name": "local"}})) == NODE_WAIT_S
    with pytest.raises(ValueError, match="node_wait_s"):
        node_wait_s(OmegaConf.create({"engine": {"node_wait_s": -1}}))


# ----- real Flower processes in a network namespace ------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    """Offline, venv first on PATH, HOME inside the test, no FLWR_HOME."""
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **fl_env(),
        **OFFLINE,
        "HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        # matplotlib's font cache from the real home: rebuilding it costs seconds
        "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")),
    }
    env.pop("FLWR_HOME", None)
    return env


def _stop_everything_under(tmp_path: Path) -> None:
    """End every process started with HOME inside `tmp_path` (the detached SuperLinks too)."""
    ours = []
    for proc in psutil.process_iter():
        try:
            if Path(proc.environ().get("HOME", "/")).is_relative_to(tmp_path):
                ours.append(proc.pid)
        except psutil.Error:
            continue
    stop_processes(ours)


def _bash_in_netns(
    script: str, tmp_path: Path, timeout: float, **env: str
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "script.sh"
    path.write_text(script)
    try:
        return subprocess.run(
            in_netns(["bash", str(path)]),
            cwd=tmp_path,
            env={**_env(tmp_path), **env},
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
    finally:
        _stop_everything_under(tmp_path)


FLWR_RUN_DEFAULT = """
cd {repo}
flwr run . --stream > {out}/run.log 2>&1
echo $? > {out}/run.rc
run_id=$(grep -o 'Successfully started run [0-9]*' {out}/run.log | grep -o '[0-9]*$')
for _ in $(seq 30); do  # the status flips a moment after the log stream ends
  flwr ls --run-id "$run_id" --format json > {out}/ls.json 2>&1
  grep -q '"finished:' {out}/ls.json && break
  sleep 1
done
"""


@pytest.mark.slow  # about 25 s: Flower starts its own simulation SuperLink
@pytest.mark.integration
def test_flwr_run_on_flowers_default_federation_fails_fast(tmp_path):
    # `flwr run .` with no connection configured: Flower writes ~/.flwr/config.toml with
    # its `local` connection and starts a simulation SuperLink of 2 SuperNodes; our
    # default num_clients=20 cannot run there, and the run must say so within seconds.
    require_netns()
    script = FLWR_RUN_DEFAULT.format(repo=REPO, out=tmp_path)
    start = time.monotonic()
    proc = _bash_in_netns(script, tmp_path, timeout=180)
    elapsed = time.monotonic() - start
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, proc.stderr + log[-3000:]
    # Flower's CLI exits 0 once the run is submitted, however the run ends.
    assert (tmp_path / "run.rc").read_text().strip() == "0", log[-3000:]
    listed = (tmp_path / "ls.json").read_text()
    run = json.loads(listed[listed.index("{") :])["runs"][0]
    assert run["status"] == "finished:failed", (run, log[-3000:])
    assert "simulation federation has 2 SuperNodes but num_clients=20" in run["status-details"]
    assert "--federation-config num-supernodes=20" in run["status-details"]
    assert "set num_clients=2" in log  # the streamed log names the fix too
    assert elapsed < 120, elapsed  # not the 300 s the ServerApp used to wait
    state = tmp_path / "home" / ".flwr"
    assert (state / "config.toml").exists() and (state / "local-superlink" / "state.db").exists()


def _one_machine_trial() -> str:
    """The shell block of section 8 of docs/DEPLOYMENT.md, as written there."""
    section = DOC.read_text().split("## 8. Trying it on one machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "section 8 should hold exactly one bash block"
    return blocks[0]


@pytest.mark.slow  # about 50 s: the whole DEPLOYMENT.md §8 trial
@pytest.mark.integration
def test_the_one_machine_trial_in_the_docs_works_verbatim(tmp_path):
    require_netns()
    block = _one_machine_trial()
    assert f"fl-run engine=deployment {' '.join(TWO_ROUNDS)}\n" in block
    # TMPDIR for its `mktemp -d` (not for Ray's sockets: their paths have a length limit)
    began = time.monotonic()
    proc = _bash_in_netns(block, tmp_path, timeout=400, TMPDIR=str(tmp_path))
    elapsed = time.monotonic() - began
    [trial] = [d for d in tmp_path.glob("tmp.*") if d.is_dir()]  # its `mktemp -d` folder
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in trial.glob("*.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    assert "completed; outputs in" in proc.stdout, proc.stdout[-3000:] + logs
    [run_dir] = [p.parent for p in trial.glob("outputs/*/*/metrics.jsonl")]
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert rows[1]["accuracy"] > rows[0]["accuracy"]
    assert all(r["bytes_up"] == r["bytes_down"] == DENSE_BYTES for r in rows)
    assert all(r["replies"] == 2 and r["failed"] == 0 for r in rows)
    assert (run_dir / "summary.json").exists()
    # FLWR_HOME exported, as the block does: Flower's files are there, none in ~/.flwr.
    assert (trial / "flwr" / "apps").is_dir()
    assert not (tmp_path / "home" / ".flwr").exists()

    # Same partitions (from --node-config), same seeds, full participation: same numbers.
    local = local_rows(*TWO_ROUNDS)
    for key in ("accuracy", "loss", "bytes_up", "bytes_down"):
        assert [r[key] for r in rows] == [r[key] for r in local], key
    # Not the time: real arrivals (the deployment's default) report the wall clock since
    # training began (~14 s a round here, against the model's 3.03), which grows and cannot
    # pass the trial's own elapsed time.
    times = [r["virtual_time_s"] for r in rows]
    assert 0 < times[0] < times[1] < elapsed, (times, elapsed)
