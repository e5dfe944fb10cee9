"""docs/STRATEGIES.md, "Two ways to run a strategy": each command runs as written there."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, fl_env, python_run, read_metrics
from netns import in_netns, require_netns

SECTION = (REPO / "docs" / "STRATEGIES.md").read_text().split("## Two ways to run a strategy")[1]
BLOCK = re.search(r"```bash\n(.*?)```", SECTION, flags=re.DOTALL)
COMMANDS = [line for line in BLOCK.group(1).splitlines() if line and not line.startswith("#")]


def test_the_section_shows_both_routes():
    assert [c.split()[:3] for c in COMMANDS] == [
        ["fl-run", "strategy=apf", "rounds=3"],
        ["python", "-m", "examples.apf_app.simulate"],
        ["python", "-m", "examples.apf_app.simulate"],
    ]


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "fl-run":
        return [sys.executable, "-m", "fl.run", *words[1:]]
    assert words[0] == "python"
    return [sys.executable, *words[1:]]


def test_fl_run_route(tmp_path):
    proc = python_run([*_argv(COMMANDS[0]), f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[-1]["frozen_fraction"] > 0 and rows[-1]["accuracy"] > 0.3
    assert "final accuracy" in proc.stdout


def _example_rows(stdout: str) -> list[dict]:
    return [
        json.loads(x.split(" ", 1)[1]) for x in stdout.splitlines() if x.startswith("apf-example ")
    ]


def test_hand_written_app_route_on_the_in_process_grid():
    proc = python_run(_argv(COMMANDS[1]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _example_rows(proc.stdout)
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[-1]["accuracy"] > 0.6


@pytest.mark.slow  # Ray start-up
@pytest.mark.integration
def test_hand_written_app_route_on_flowers_simulation():
    require_netns()  # Ray probes 8.8.8.8 on start: loopback only
    proc = subprocess.run(
        in_netns(_argv(COMMANDS[2])), cwd=REPO, env=fl_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _example_rows(proc.stdout)
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[-1]["accuracy"] > 0.6
