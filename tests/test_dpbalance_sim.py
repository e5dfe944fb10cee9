"""The §VI scheduling study: workload shape, every scheduler on a real ledger, the CLI's outputs."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import python_run

from privacy.dpbalance import make_scheduler
from privacy.simulation import Workload, generate, simulate, summarize


def test_generated_workload_has_the_papers_shape():
    w = Workload()
    gen = generate(w)
    pipelines = [a.pipeline for a in gen.arrivals]
    assert len(pipelines) == 150 and len(gen.budgets) == 100
    assert all(1.0 <= b <= 1.5 for b in gen.budgets)
    per_analyst = {p.analyst for p in pipelines}
    assert len(per_analyst) == 6
    assert all(sum(p.analyst == a for p in pipelines) == 25 for a in per_analyst)
    epsilons = [next(iter(p.demand.values())) for p in pipelines]
    mice = [e for e in epsilons if e <= 0.015]
    assert all(0.005 <= e <= 0.015 or 0.095 <= e <= 0.105 for e in epsilons)
    assert 0.6 < len(mice) / 150 < 0.9  # 75 % mice
    times = [a.time for a in gen.arrivals]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 100
    for p in pipelines:  # every targeted device contributes its latest 1 or 10 blocks
        devices = {b.split("/")[0] for b in p.demand}
        assert len(p.demand) // len(devices) in (1, 2, 4, 6, 8, 10)
        assert len(devices) in (20, 100)


def test_every_scheduler_runs_on_a_consistent_ledger():
    w = Workload(devices=10, rounds=4, analysts=3, pipelines_per_analyst=6, seed=1)
    results = {}
    for name in ("dpbalance", "dpf", "dpk", "fcfs"):
        records = simulate(make_scheduler(name, n=10), w)  # raises if the ledger is inconsistent
        assert [r.round for r in records] == [1, 2, 3, 4]
        results[name] = summarize(records, beta=2.2)
    assert all(0 < s["served"] <= 18 for s in results.values())
    assert results["dpbalance"]["kappa_sum"] >= results["dpbalance"]["served"]  # κ ≥ 1
    for name in ("dpf", "dpk", "fcfs"):
        assert results[name]["kappa_sum"] == results[name]["served"]  # baselines: κ = 1
    assert simulate(make_scheduler("dpbalance"), w)[-1].utilities == pytest.approx(
        simulate(make_scheduler("dpbalance"), w)[-1].utilities
    )  # deterministic


def test_cli_writes_table_json_and_plot(tmp_path):
    proc = python_run(
        [
            sys.executable,
            "-m",
            "privacy.cli",
            "simulate",
            "--devices",
            "10",
            "--rounds",
            "3",
            "--analysts",
            "3",
            "--pipelines",
            "5",
            "--betas",
            "0.5",
            "2.2",
            "--out",
            str(tmp_path),
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "dpbalance_sim.json").read_text())
    assert [row["beta"] for row in result["table"]] == [0.5, 2.2]
    for row in result["table"]:
        for name in ("dpf", "dpk", "fcfs"):
            gain = row[f"efficiency_gain_vs_{name}"]
            assert gain == pytest.approx(row["dpbalance"]["efficiency"] / row[name]["efficiency"])
    table = (tmp_path / "dpbalance_sim.md").read_text()
    assert table.count("| DPBalance |") == 2 and "| 2.2 | FCFS |" in table
    assert (tmp_path / "dpbalance_sim.png").read_bytes()[:4] == b"\x89PNG"
    assert "| DPBalance |" in proc.stdout
