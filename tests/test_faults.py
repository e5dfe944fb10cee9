"""Injected client faults: reproducible draws, and runs that survive them."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, run_fl

from fl.run.faults import draw_fault


def test_fault_draws_match_rates_and_are_reproducible():
    rates = {"crash": 0.1, "dropout": 0.2, "hang": 0.05}
    draws = [draw_fault(0, rnd, p, rates) for rnd in range(1, 51) for p in range(200)]
    assert draws == [draw_fault(0, rnd, p, rates) for rnd in range(1, 51) for p in range(200)]
    share = {kind: draws.count(kind) / len(draws) for kind in ("crash", "dropout", "hang")}
    assert abs(share["crash"] - 0.1) < 0.01
    assert abs(share["dropout"] - 0.2) < 0.01
    assert abs(share["hang"] - 0.05) < 0.01
    assert draw_fault(0, 1, 0, {}) == ""


def test_thirty_percent_faulty_clients_per_round_still_learn(tmp_path):
    run_fl(tmp_path / "clean")
    run_fl(tmp_path / "faulty", "faults=mixed")  # default deadline: derived from the system
    clean, faulty = read_metrics(tmp_path / "clean"), read_metrics(tmp_path / "faulty")
    assert len(faulty) == len(clean) == 30
    failed = sum(r["failed"] for r in faulty)
    missing = sum(r["missing"] for r in faulty)
    # 20 clients x 30 rounds: ~60 crashes, ~120 dropouts or hangs
    assert 30 < failed < 90 and 80 < missing < 160
    assert all(r["replies"] == r["clients"] - r["failed"] - r["missing"] for r in faulty)
    assert faulty[-1]["accuracy"] > clean[-1]["accuracy"] - 0.02
    # a round with missing replies lasts until the deadline the server waited for: by
    # default twice the slowest device's full round (identical devices here: twice the
    # clean run's round, whose slowest client holds the largest partition), not an hour
    slowest = max(r["round_time_s"] for r in clean)
    waited = [r["round_time_s"] for r in faulty if r["missing"]]
    assert waited and all(t == pytest.approx(2 * slowest, rel=1e-6) for t in waited)
    summary = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert summary["rounds"] == 30
