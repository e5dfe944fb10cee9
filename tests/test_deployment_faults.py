"""A real SuperNode killed mid-run: the rounds go on with the replies that arrive."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import read_metrics
from test_deployment import _submit, running_federation

NODES = 3


@pytest.fixture
def federation(tmp_path):
    with running_federation(tmp_path, NODES) as fed:
        yield fed


@pytest.mark.integration
def test_killed_supernode_does_not_stop_the_run(federation, tmp_path):
    run_dir = tmp_path / "run"
    victim = federation.procs[-1]  # the SuperNode holding partition 2

    def kill_after_first_round() -> None:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                os.killpg(victim.pid, signal.SIGKILL)  # the node and its ClientApp, at once
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_after_first_round, daemon=True)
    killer.start()
    proc = _submit(
        federation,
        run_dir,
        f"num_clients={NODES}",
        f"clients_per_round={NODES}",
        "rounds=3",
        "local_epochs=1",
        "round_timeout_s=20",
    )
    killer.join(timeout=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + federation.logs()
    assert victim.poll() is not None, "the SuperNode was never killed"
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[0]["replies"] == NODES and rows[0]["missing"] == 0
    for row in rows[1:]:  # the dead node's work never arrives; the others' does
        assert row["replies"] == NODES - 1 and row["missing"] == 1
        assert row["round_time_s"] >= 20  # the server waited out the deadline
    assert rows[-1]["accuracy"] > 0.3
