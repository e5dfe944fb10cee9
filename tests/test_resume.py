"""Resume: a run killed with SIGKILL continues from its checkpoint to the same metrics."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import fl_run_cmd, python_popen, python_run, read_metrics, run_fl, without_wall_time

RUN = [
    "num_clients=8",
    "clients_per_round=5",
    "rounds=12",
    "local_epochs=1",
    "system=heterogeneous",
]


def _kill_after_rows(run_dir, rows: int, *overrides: str) -> int:
    """Start a run, SIGKILL it once metrics.jsonl has `rows` rows; return rows written."""
    proc = python_popen(
        fl_run_cmd(f"hydra.run.dir={run_dir}", *overrides), capture=False, stderr=False
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    return len(metrics.read_text().splitlines())


def assert_resumes_identically(tmp_path: Path, run: list[str], rounds: int) -> None:
    """`run` uninterrupted in tmp_path/full, and killed after round 3 then resumed in
    tmp_path/killed: every round's metrics identical (wall time aside)."""
    run_fl(tmp_path / "full", *run, fresh=True)  # own hash seed: forked runs share one
    written = _kill_after_rows(tmp_path / "killed", 3, *run)
    assert 3 <= written < rounds
    run_fl(tmp_path / "killed", *run, "resume=true")
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "killed")
    assert [r["round"] for r in resumed] == list(range(1, rounds + 1))
    assert without_wall_time(resumed) == without_wall_time(full)


@pytest.mark.parametrize(
    "strategy",
    [
        # stateless: the APF case below and tests/test_run_dir.py cover the same path
        pytest.param(["strategy=fedavg"], marks=pytest.mark.slow),
        # stateful on both sides: freezing state on the server, synced copies on clients
        ["strategy=apf", "strategy.ema_alpha=0.5", "strategy.threshold=0.3"],
    ],
    ids=["fedavg", "apf"],
)
def test_killed_run_resumes_to_identical_metrics(tmp_path, strategy):
    assert_resumes_identically(tmp_path, [*RUN, *strategy], rounds=12)
    assert (tmp_path / "killed" / "model.pt").read_bytes() == (
        tmp_path / "full" / "model.pt"
    ).read_bytes()


def test_resume_without_checkpoint_says_where_it_looked(tmp_path):
    proc = python_run(
        fl_run_cmd(f"hydra.run.dir={tmp_path}", "resume=true", "rounds=2"), timeout=120
    )
    assert proc.returncode != 0
    assert f"no checkpoint at {tmp_path}/checkpoint.pt" in proc.stderr
