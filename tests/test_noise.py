"""What surrounds the per-round table: no Flower chatter from strategy=flower, our own
lines under our own logger names, and a time column named after the clock that fills it."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

from conftest import REPO, python_run

from fl.run.console import RoundReporter

ROW = {
    "round": 1,
    "accuracy": 0.5,
    "loss": 1.0,
    "bytes_up": 1000,
    "bytes_down": 1000,
    "round_time_s": 2.0,
    "virtual_time_s": 2.0,
    "failed": 0,
    "missing": 0,
    "rejected": 0,
}
SUMMARY = {
    "rounds": 1,
    "final_accuracy": 0.5,
    "best_accuracy": 0.5,
    "total_bytes_up": 1000,
    "total_bytes_down": 1000,
    "virtual_time_s": 2.0,
}


def _lines(arrival: str) -> list[str]:
    out = io.StringIO()
    reporter = RoundReporter(1, 0, "fedavg", enabled=True, stream=out, arrival=arrival)
    reporter.round_done(ROW)
    reporter.close(SUMMARY, Path("outputs/x"))
    return out.getvalue().splitlines()


def test_real_arrivals_label_the_time_column_wall_time():
    header, _, final = _lines("real")
    assert "wall time" in header and "virtual" not in header
    assert "2.00 s wall time" in final and "virtual" not in final
    header, _, final = _lines("virtual")
    assert "virtual time" in header and "2.00 s virtual time" in final


def test_strategy_flower_prints_no_flower_chatter_between_rows(tmp_path):
    overrides = ["strategy=flower", "rounds=2", "num_clients=4", "clients_per_round=4"]
    cmd = [sys.executable, "-m", "fl.run", f"hydra.run.dir={tmp_path}", *overrides]
    proc = python_run(cmd)  # progress=true: the table, as a user sees it
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "Sampled 0 nodes" not in out and "Received 4 results" not in out
    assert len(re.findall(r"^\s+[12]\s+0\.\d{4}", proc.stdout, re.M)) == 2  # the table's rows


def test_our_own_lines_are_not_logged_under_flowers_name():
    # Flower's `log` writes under `[flwr]`; the kernel and the server log under their module
    # names (the SuperNode-side cluster client keeps Flower's: a SuperNode shows only `flwr`).
    offenders = [
        path.relative_to(REPO)
        for package in ("fl", "server")
        for path in sorted((REPO / package).rglob("*.py"))
        if "from flwr.common.logger import log" in path.read_text()
    ]
    assert offenders == []
