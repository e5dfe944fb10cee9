"""Shared fixtures: run `fl-run` for real in its own process, offline, in a temp directory.

`python_run` / `python_popen` start `python -m MODULE` or `python -c CODE` as a real
process forked from a server that has already imported torch, Flower and the rest
(tests/forkrun.py); `fresh=True` starts a new interpreter instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import forkrun
import pytest
import quick

from fl import OFFLINE_ENV

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {**OFFLINE_ENV, "WANDB_MODE": "offline"}  # tests stay offline whatever the user set
os.environ.update(OFFLINE)
# torch picks its CPU kernels by the machine's instruction set, and its AVX-512 kernels round
# sums differently from its AVX2 ones: recorded figures are AVX2's, on any x86 machine.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")


def fl_env() -> dict[str, str]:
    """The environment every process we start gets: offline, unbuffered."""
    return {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1"}


def fl_run_cmd(*overrides: str) -> list[str]:
    """The command line of `fl-run` with these Hydra overrides."""
    return [sys.executable, "-m", "fl.run", *overrides, "progress=false"]


def python_run(
    cmd: list[str],
    *,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, capture_output=True, text=True)` for `[sys.executable, "-m" |
    "-c", ...]`, in a forked process (see tests/forkrun.py) unless `fresh`."""
    return forkrun.run(
        cmd, cwd=cwd, env=fl_env() if env is None else env, timeout=timeout, fresh=fresh
    )


def python_popen(
    cmd: list[str],
    *,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    capture: bool = True,
    stderr: bool = True,
    stream: bool = False,
    fresh: bool = False,
) -> forkrun.ForkedProcess | subprocess.Popen[str]:
    """`subprocess.Popen(cmd, text=True)`, stdout and stderr captured or discarded (or
    stdout read as it comes, `stream`), for `[sys.executable, "-m" | "-c", ...]`, in a
    forked process unless `fresh`."""
    env = fl_env() if env is None else env
    return forkrun.popen(
        cmd, cwd=cwd, env=env, capture=capture, stderr=stderr, stream=stream, fresh=fresh
    )


def run_fl(
    run_dir: Path, *overrides: str, timeout: float = 300, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run `fl-run` to completion with outputs in `run_dir`; fail with its output if it fails.

    `fresh`: in a new interpreter (for one side of a determinism comparison: forked runs
    share the string-hash seed, see tests/forkrun.py).
    """
    proc = python_run(
        fl_run_cmd(f"hydra.run.dir={run_dir}", *overrides), timeout=timeout, fresh=fresh
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def train_in_process(
    out: Path, *overrides: str, grid_class: Any = None
) -> tuple[list[dict[str, Any]], Any]:
    """The round loop of `fl-run` with these overrides (validated first, as fl-run does),
    in this process on a LocalGrid or `grid_class`: the metrics rows and the grid."""
    import clients.app as client
    from fl.common.config import compose, to_run_config
    from fl.run.engines.local import LocalGrid
    from fl.run.validation import validate
    from server.loop import run_training

    cfg = compose(list(overrides))
    validate(cfg)
    grid = (grid_class or LocalGrid)(client.app, cfg.num_clients, to_run_config(cfg))
    run_training(grid, cfg, out)
    return read_metrics(out), grid


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_wall_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with wall-clock fields removed, for determinism comparisons."""
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]


# The longest files first. xdist hands a worker whole files in collection order (pyproject:
# --dist loadfile --no-loadscope-reorder; its default puts the files with fewest tests last,
# which are the long end-to-end ones): a long file at the end leaves the other worker idle.
# Worker seconds per file, longest first (`pytest --durations=0` summed by file, 2026-12-06, 2
# quiet cores); any file not named runs after these, in collection order.
LONGEST_FIRST = (
    "test_sweeps.py",  # 96 s: launchers, a killed sweep, a tuned preset
    "test_presets.py",  # 67 s: every quick sweep
    "test_engine_flower_sim.py",  # 62 s, Ray: mostly waiting, good company for a busy worker
    "test_run_dir.py",  # 47 s
    "test_strategy_identity.py",  # 26 s
    "test_run.py",  # 26 s
    "test_tls_deployment.py",  # 24 s
    "test_outsiders.py",  # 21 s
    "test_deployment.py",  # 21 s
    "test_privacy_dpsgd.py",  # 17 s
    "test_config_errors.py",  # 16 s
    "test_cohort.py",  # 15 s
    "test_quick_target.py",  # 13 s
    "test_ledger_races.py",  # 12 s
    "test_optimizers.py",  # 9 s
    "test_plugin_without_config.py",  # 9 s
    "test_resume.py",  # 9 s
    "test_pas.py",  # 8 s
    "test_safe_writes.py",  # 8 s
    "test_loops.py",  # 8 s
    "test_trusted_figures.py",  # 8 s
    "test_flower_plugin.py",  # 8 s
    "test_gift.py",  # 7 s
    "test_robust.py",  # 7 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
    for item in items:  # `make test-quick`: tests/quick.py's selection, never a slow test
        if item.get_closest_marker("slow") is None and any(
            quick.selects(item.nodeid, entry) for entry in quick.QUICK
        ):
            item.add_marker(pytest.mark.quick)


@pytest.fixture
def tiny_overrides() -> list[str]:
    """A small, fast digits run."""
    return ["num_clients=6", "clients_per_round=4", "rounds=3", "local_epochs=1"]
