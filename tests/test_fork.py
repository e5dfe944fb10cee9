"""fork_from=<run_dir>@<round>: a new run from a kept checkpoint; the source is only read."""

from __future__ import annotations

import hashlib

import pytest
from conftest import fl_run_cmd, python_run, read_metrics, run_fl, without_wall_time

BASE = ["num_clients=4", "clients_per_round=3", "local_steps=3", "system=heterogeneous"]
RUN = [
    *BASE,
    # stateful on both sides: freezing state on the server, synced copies on clients
    "strategy=graft",
    "strategy.diagnosis=stepping",
    "strategy.action=freeze+bits",
    "strategy.threshold=0.3",
    "strategy.smoothing=0.5",
]


def _digests(run_dir):
    return {
        p.relative_to(run_dir): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def test_fork_continues_bit_identically_and_leaves_the_source_untouched(tmp_path):
    source, fork = tmp_path / "source", tmp_path / "fork"
    run_fl(source, *RUN, "rounds=4", "checkpoint_history=true")
    kept = sorted(p.name for p in (source / "checkpoints").iterdir())
    assert kept == [f"round-0000{r}.pt" for r in range(1, 5)]
    before = _digests(source)

    run_fl(fork, *RUN, "rounds=4", f"fork_from={source}@2")
    assert without_wall_time(read_metrics(fork)) == without_wall_time(read_metrics(source))
    assert (fork / "model.pt").read_bytes() == (source / "model.pt").read_bytes()
    assert _digests(source) == before


@pytest.mark.slow
def test_a_branch_changes_settings_from_the_fork_round_on(tmp_path):
    source, branch = tmp_path / "source", tmp_path / "branch"
    run_fl(source, *RUN, "rounds=3", "checkpoint_history=true")
    run_fl(branch, *RUN, "rounds=3", "local_steps=6", f"fork_from={source}@2")
    rows, original = read_metrics(branch), read_metrics(source)
    assert without_wall_time(rows[:2]) == without_wall_time(original[:2])
    assert rows[2]["round_time_s"] > original[2]["round_time_s"]  # twice the local steps


@pytest.mark.slow
def test_fork_refuses_a_missing_round_another_strategy_and_the_source_dir(tmp_path):
    source = tmp_path / "source"
    run_fl(source, *RUN, "rounds=2")  # no history: only the last round can be forked

    def fails(run_dir, *overrides):
        proc = python_run(fl_run_cmd(f"hydra.run.dir={run_dir}", *overrides))
        assert proc.returncode != 0
        return proc.stderr

    assert "no checkpoint of round 1 (kept rounds: none)" in fails(
        tmp_path / "a", *RUN, f"fork_from={source}@1"
    )
    assert "cannot fork" in fails(tmp_path / "b", *BASE, f"fork_from={source}@2")  # fedavg
    assert "already holds a run" in fails(source, *RUN, f"fork_from={source}")
    assert "fork_from" in fails(tmp_path / "c", *RUN, f"fork_from={source}@0")
    run_fl(tmp_path / "latest", *RUN, "rounds=3", f"fork_from={source}")  # its last round
    assert [r["round"] for r in read_metrics(tmp_path / "latest")] == [1, 2, 3]


def test_fork_copies_the_checkpoint_that_loaded_and_a_broken_one_never_answers_a_round(tmp_path):
    source, fork = tmp_path / "source", tmp_path / "fork"
    small = ["num_clients=3", "clients_per_round=3", "local_steps=2"]
    run_fl(source, *small, "rounds=2")  # checkpoint.pt: round 2, checkpoint.prev.pt: round 1
    previous = (source / "checkpoint.prev.pt").read_bytes()
    (source / "checkpoint.pt").write_bytes(b"garbage")

    def one_line(run_dir, *overrides):
        proc = python_run(fl_run_cmd(f"hydra.run.dir={run_dir}", *small, *overrides))
        assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
        return proc.stderr.strip().splitlines()[-1]

    line = one_line(tmp_path / "at2", "rounds=3", f"fork_from={source}@2")
    assert "has no checkpoint of round 2" in line  # the garbage newest file holds no round
    assert not (tmp_path / "at2" / ".hydra").exists()
    run_fl(fork, *small, "rounds=2", f"fork_from={source}")  # falls back to round 1's file
    assert [r["round"] for r in read_metrics(fork)] == [1, 2]  # round 1 from the source
    assert previous != (fork / "checkpoint.pt").read_bytes()  # the fork wrote its own since
    assert not (fork / "checkpoint.pt").read_bytes().startswith(b"garbage")
