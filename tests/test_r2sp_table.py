"""experiments/r2sp_table.py: virtual time to accuracy per arm against BSP, and with
`--relative` to a fraction of each seed's BSP final, paired by seed; runs are read as
`fl.run.compare` reads them (finished jobs, regular files only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from experiments import r2sp_table
from fl.common.files import NotRegularFile

BSP = ["loop.groups=1", "strategy=fedavg"]
R2SP = ["loop.groups=4", "strategy=r2sp"]


def _run(sweep: Path, job: int, arm: list[str], seed: int, curve: list[tuple[float, float]]):
    """A finished job: `curve` is its (virtual time, accuracy) per round."""
    folder = sweep / str(job)
    (folder / ".hydra").mkdir(parents=True)
    overrides = ["experiment=r2sp_room", *arm, f"seed={seed}", "progress=false"]  # not a label
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    rows = [
        {"round": i + 1, "virtual_time_s": t, "accuracy": acc} for i, (t, acc) in enumerate(curve)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"final_accuracy": curve[-1][1]}))


def _sweep(tmp_path: Path) -> Path:
    """BSP climbs to 0.95 at 50 s; R2SP reaches BSP's levels in half the time (seed 0) and
    in three quarters of it (seed 1)."""
    sweep = tmp_path / "sweep"
    bsp = [(10.0, 0.2), (20.0, 0.4), (30.0, 0.6), (40.0, 0.8), (50.0, 0.95)]
    job = 0
    for seed, speed in ((0, 0.5), (1, 0.75)):
        _run(sweep, job, BSP, seed, bsp)
        _run(sweep, job + 1, R2SP, seed, [(t * speed, acc) for t, acc in bsp])
        job += 2
    return sweep


def test_the_relative_target_is_paired_with_bsp_seed_by_seed(tmp_path):
    out = r2sp_table.relative_table(_sweep(tmp_path), fraction=0.9, window=1)
    assert "seed=0: 0.855, seed=1: 0.855" in out  # 0.9 × BSP's final 0.95
    r2sp = next(line for line in out.splitlines() if "strategy=r2sp" in line)
    # both reach 0.855 at their 5th round: 25 s and 37.5 s against BSP's 50 s
    assert "| 2 | 2 | 0.625 [" in r2sp and "| 0.50, 0.75 |" in r2sp


def test_the_time_table_reads_the_first_job_as_bsp(tmp_path):
    out = r2sp_table.table(_sweep(tmp_path))
    line = next(line for line in out.splitlines() if "strategy=r2sp seed=0" in line)
    # 0.90 at 25 s (BSP: 50 s), 0.94 too; a cycle of 4 groups is 4 × 25 s / 5 rounds
    assert line == (
        "| loop.groups=4 strategy=r2sp seed=0 | 25.0 | 0.50 | 25.0 | 0.50 "
        "| 20.00 | 5 | 0.950 | 0.950 | 0 |"
    )


def test_a_metrics_file_that_is_not_a_regular_file_is_refused_not_waited_on(tmp_path):
    sweep = _sweep(tmp_path)
    (sweep / "1" / "metrics.jsonl").unlink()
    os.mkfifo(sweep / "1" / "metrics.jsonl")  # a reader of a FIFO would block
    with pytest.raises(NotRegularFile, match="is a FIFO, not a regular file"):
        r2sp_table.relative_table(sweep, fraction=0.9, window=1)
