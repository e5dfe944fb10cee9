"""A run refused before its first round says why in one line and leaves no folder behind
(issue 36, class 5): config errors found early or late, a missing trace file, a fork from
a crafted history file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import fl_run_cmd, python_run, read_metrics, run_fl

from fl.run.checkpoint import history_path, load_checkpoint, save_checkpoint

SMALL = ("num_clients=3", "clients_per_round=3", "local_steps=2", "plots=false")


def _refused(run_dir: Path, *overrides: str) -> str:
    """The one error line of a refused run; its folder must be gone."""
    proc = python_run(fl_run_cmd(f"hydra.run.dir={run_dir}", *SMALL, *overrides))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "overrides",
    [
        ("num_clients=0", "rounds=-1"),  # two errors, found in validation
        ("+system.availability_trace=/nonexistent/trace.json",),  # was a traceback in round 1
        ("+system.speed_trace=sine",),
    ],
    ids=["two errors", "missing trace", "unknown trace kind"],
)
def test_a_config_error_is_one_line_and_leaves_no_folder(tmp_path: Path, overrides) -> None:
    line = _refused(tmp_path / "run", *overrides)
    assert line.startswith("fl-run: invalid config: "), line
    if "availability" in overrides[0]:
        assert "system.availability_trace" in line and "No such file" in line


def test_a_fork_from_a_crafted_history_file_leaves_no_half_made_folder(tmp_path: Path) -> None:
    source = tmp_path / "source"
    run_fl(source, *SMALL, "rounds=2", "checkpoint_history=true", "strategy=fedsu")
    kept = history_path(source, 1)
    saved = load_checkpoint(kept)
    saved["strategy"]["control"].speculation.slope[0] = math.nan  # loads, then is refused
    kept.unlink()  # (a hard link to the round's checkpoint: replaced, not written through)
    save_checkpoint(tmp_path / "crafted.pt", saved)
    (tmp_path / "crafted.pt").rename(kept)
    before = sorted(p.name for p in source.rglob("*"))
    line = _refused(tmp_path / "fork", "rounds=3", "strategy=fedsu", f"fork_from={source}@1")
    assert line.startswith("fl-run: checkpoint: ") and "slope has NaN" in line, line
    assert sorted(p.name for p in source.rglob("*")) == before  # the source is only read
    # the same fork from an honest round still works in the same place afterwards
    run_fl(tmp_path / "fork", *SMALL, "rounds=3", "strategy=fedsu", f"fork_from={source}@2")
    assert [r["round"] for r in read_metrics(tmp_path / "fork")] == [1, 2, 3]
