"""Shared fixtures: run `fl-run` for real in a subprocess, offline, in a temp directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "WANDB_MODE": "offline",
}
os.environ.update(OFFLINE)


def fl_env() -> dict[str, str]:
    """The environment every process we start gets: offline, unbuffered."""
    return {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1"}


def fl_run_cmd(*overrides: str) -> list[str]:
    """The command line of `fl-run` with these Hydra overrides."""
    return [sys.executable, "-m", "fl.run", *overrides, "progress=false"]


def run_fl(
    run_dir: Path, *overrides: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run `fl-run` to completion with outputs in `run_dir`; fail with its output if it fails."""
    proc = subprocess.run(
        fl_run_cmd(f"hydra.run.dir={run_dir}", *overrides),
        cwd=REPO,
        env=fl_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_wall_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with wall-clock fields removed, for determinism comparisons."""
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]


@pytest.fixture
def tiny_overrides() -> list[str]:
    """A small, fast digits run."""
    return ["num_clients=6", "clients_per_round=4", "rounds=3", "local_epochs=1"]
