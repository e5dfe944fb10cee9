"""engine=flower-sim: our ServerApp/ClientApp on Flower's Ray simulation, offline and exact."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import OFFLINE, REPO, fl_env, fl_run_cmd, read_metrics, run_fl
from netns import in_netns, require_netns

from clients.cohort import METRIC_TOLERANCE

pytestmark = pytest.mark.integration

RUN = ["num_clients=4", "clients_per_round=4", "rounds=2", "task=digits", "local_epochs=1"]
DENSE_BYTES = 4 * 4810 * 4  # 4 clients x MLP 64-64-10 (4,810 float32 parameters), each way


def _sim(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    # Ray probes 8.8.8.8 on every start: a loopback-only namespace keeps that off the network.
    require_netns()
    env = {**fl_env(), **OFFLINE}  # explicit, although importing `fl` sets them too
    return subprocess.run(
        in_netns(fl_run_cmd(f"hydra.run.dir={run_dir}", "engine=flower-sim", *overrides)),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # Ray starts in 15 s on an idle 2-core machine, minutes on a busy one
    )


@pytest.mark.slow  # a second Ray start (about 60 s); the semi-async test below is the default
def test_flower_sim_trains_and_matches_local_engine(tmp_path):
    proc = _sim(tmp_path / "sim", *RUN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[flwr][DEBUG]" not in proc.stdout  # conf/config.yaml sets flwr to INFO
    sim = read_metrics(tmp_path / "sim")
    assert [r["round"] for r in sim] == [1, 2]
    assert sim[0]["accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert sim[1]["accuracy"] > sim[0]["accuracy"]
    assert all(r["bytes_up"] == r["bytes_down"] == DENSE_BYTES for r in sim)
    assert all(r["replies"] == 4 and r["failed"] == 0 for r in sim)

    # Same config, in-process engine: with every client training each round, the selected
    # partitions, per-client seeds and aggregation agree, so the numbers are bit-identical.
    run_fl(tmp_path / "local", *RUN, "engine=local")
    local = read_metrics(tmp_path / "local")
    for key in ("accuracy", "loss", "bytes_up", "bytes_down", "virtual_time_s"):
        assert [r[key] for r in sim] == [r[key] for r in local], key


def test_flower_sim_semi_async_matches_local_engine(tmp_path):
    # Replies land rounds after they were asked for (staleness > 0): arrival order is the
    # virtual clock's on both engines, so the same replies land in the same rounds.
    run = [
        "num_clients=6", "clients_per_round=4", "rounds=4", "local_steps=4",
        "loop=semi_async", "loop.buffer_k=2", "system=heterogeneous",
    ]  # fmt: skip
    proc = _sim(tmp_path / "sim", *run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[flwr][DEBUG]" not in proc.stdout  # conf/config.yaml sets flwr to INFO
    # offline (a loopback-only namespace), Ray's address probe and its GPU tip stay quiet
    assert "8.8.8.8" not in proc.stdout + proc.stderr
    assert "FutureWarning" not in proc.stdout + proc.stderr
    run_fl(tmp_path / "local", *run, "engine=local")
    sim, local = read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "local")
    assert [r["replies"] for r in sim] == [2, 2, 2, 2]
    assert max(r["staleness_max"] for r in sim) >= 1
    for key in ("accuracy", "loss", "bytes_up", "bytes_down", "virtual_time_s", "staleness_max"):
        assert [r[key] for r in sim] == [r[key] for r in local], key


def test_flower_sim_trains_cohorts_on_carrier_actors(tmp_path):
    # engine.cohort=auto: each round's train messages travel as two envelopes, each trained
    # as one cohort by one Ray actor; FedSU's clients keep state (error feedback) between
    # rounds, which lives with their carrier. Same metrics as client by client, within the
    # cohort's documented tolerance; counts, bytes and virtual time exactly.
    run = ["num_clients=8", "clients_per_round=8", "rounds=3", "strategy=fedsu"]
    proc = _sim(tmp_path / "sim", *run, "engine.cohort=auto")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "8 train messages on carriers, cohort: 4 clients of fedsu" in proc.stdout
    run_fl(tmp_path / "local", *run, "engine=local")
    sim, local = read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "local")
    for key in ("bytes_up", "bytes_down", "virtual_time_s", "replies"):
        assert [r[key] for r in sim] == [r[key] for r in local], key
    for key in ("accuracy", "loss"):
        assert [r[key] for r in sim] == pytest.approx([r[key] for r in local], **METRIC_TOLERANCE)


@pytest.mark.slow  # about 15 s of Ray start-up; the one-line refusal is tested on the local engine
def test_flower_sim_fails_loudly_when_the_server_app_raises(tmp_path):
    # resume=true without a checkpoint: the ServerApp raises inside Flower's simulation.
    proc = _sim(tmp_path, "num_clients=2", "clients_per_round=2", "rounds=1", "resume=true")
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[-1].startswith(f"fl-run: no checkpoint at {tmp_path}")
    assert not (tmp_path / "metrics.jsonl").exists()
