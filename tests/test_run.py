"""`fl-run` end to end, as a user runs it: outputs, validation, sweeps, determinism, scale."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from conftest import fl_run_cmd, python_run, read_metrics, run_fl, without_wall_time

ROW_KEYS = {"round", "accuracy", "loss", "bytes_up", "bytes_down", "virtual_time_s", "wall_time_s"}


def test_run_writes_every_output(tmp_path, tiny_overrides):
    run_fl(tmp_path, *tiny_overrides, "target_accuracy=0.3")
    rows = read_metrics(tmp_path)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[0].keys() >= ROW_KEYS
    # 4 clients per round, dense MLP 64-64-10 (4,810 float32) each way
    assert all(r["bytes_up"] == r["bytes_down"] == 4 * 4810 * 4 for r in rows)
    assert rows[-1]["virtual_time_s"] > rows[0]["virtual_time_s"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_accuracy"] == rows[-1]["accuracy"]
    assert summary["best_accuracy"] == max(r["accuracy"] for r in rows)
    assert summary["total_bytes_up"] == 3 * 4 * 4810 * 4
    assert summary["rounds_to_target"] in (1, 2, 3) and summary["target_window"] == 5
    hit = rows[summary["rounds_to_target"] - 1]  # the trailing mean (here of 1-3 rounds)
    trailing = [r["accuracy"] for r in rows[: hit["round"]]][-5:]
    assert sum(trailing) / len(trailing) >= 0.3
    assert summary["bytes_to_target"] == hit["cum_bytes_up"] + hit["cum_bytes_down"]
    assert summary["time_to_target_s"] == hit["virtual_time_s"]
    # the machine, which decides a long run's last bits (RESULTS, FedCA with room)
    assert summary["machine"]["torch"] == torch.__version__
    assert summary["machine"]["torch_cpu_capability"] in ("DEFAULT", "AVX2", "AVX512")
    assert summary["machine"]["cpu"]
    assert summary["machine"]["onednn_max_cpu_isa"] == os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL")
    for name in ("config.yaml", "checkpoint.pt", "accuracy.png", "model.pt"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_same_seed_gives_identical_metrics(tmp_path, tiny_overrides):
    run_fl(tmp_path / "a", *tiny_overrides, "system=heterogeneous")
    # a new interpreter: its own string-hash seed (forked runs share one)
    run_fl(tmp_path / "b", *tiny_overrides, "system=heterogeneous", fresh=True)
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert without_wall_time(a) == without_wall_time(b)
    run_fl(tmp_path / "c", *tiny_overrides, "system=heterogeneous", "seed=1")
    assert without_wall_time(read_metrics(tmp_path / "c")) != without_wall_time(a)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("nonsense_key=3", "nonsense_key"),
        ("clients_per_round=50", "clients_per_round"),
        ("lr=-1", "lr"),
        ("strategy.mu=-0.5", "mu"),
        ("+strategy.tau=2", "tau"),
        ("task=imagenet", "imagenet"),
    ],
)
def test_bad_config_fails_before_round_one_naming_the_key(tmp_path, override, named):
    proc = python_run(
        fl_run_cmd(f"hydra.run.dir={tmp_path}", "strategy=fedprox", override), timeout=120
    )
    assert proc.returncode != 0
    assert named in proc.stderr + proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


def test_fedprox_on_synthetic_iid_learns(tmp_path):
    run_fl(
        tmp_path,
        "strategy=fedprox",
        "task=synthetic",
        "partition=iid",
        "num_clients=50",
        "rounds=10",
        "lr=0.05",
    )
    rows = read_metrics(tmp_path)
    assert len(rows) == 10
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
    assert rows[-1]["accuracy"] > 0.3  # 10 classes


def test_multirun_sweep_runs_every_combination(tmp_path):
    proc = python_run(
        fl_run_cmd(
            "-m",
            "experiment=smoke",
            "strategy=fedavg,fedprox",
            "seed=0,1",
            f"hydra.sweep.dir={tmp_path}",
        ),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert len(summaries) == 4
    configs = {(p.parent / "config.yaml").read_text() for p in summaries}
    assert len(configs) == 4
    # every multirun ends with the comparison table: one row per run, and per arm the mean
    # over seeds with its 95 % t-interval
    text = (tmp_path / "comparison.md").read_text()
    assert text.startswith(f"# {tmp_path.name}\n")
    for label in ("fedavg seed=0", "fedavg seed=1", "fedprox seed=0", "fedprox seed=1"):
        assert f"| strategy={label} | 0." in text
    assert re.search(r"\| strategy=fedprox \| 2 \| 0\.\d{4} \[-?\d\.\d{4}, \d\.\d{4}\] \|", text)
    assert "Paired with `strategy=fedavg` seed by seed" in text  # and fedprox's Δ and ratios
    assert (tmp_path / "comparison.png").stat().st_size > 0
    assert "comparison written to" in proc.stdout


def test_thousand_clients_two_rounds(tmp_path):
    run_fl(
        tmp_path,
        "task=synthetic",
        "partition=natural",
        "num_clients=1000",
        "clients_per_round=1000",
        "rounds=2",
        "local_epochs=1",
        "batch_size=16",
        "lr=0.05",
    )
    rows = read_metrics(tmp_path)
    assert [r["replies"] for r in rows] == [1000, 1000]
    assert rows[1]["loss"] < rows[0]["loss"]  # Synthetic(0.5, 0.5) learns slowly, but it learns


def test_time_budget_stops_at_equal_virtual_time(tmp_path):
    # uniform system: one epoch of ~360 samples at 500 samples/s is ~0.75 s per round
    run_fl(
        tmp_path,
        "num_clients=4",
        "clients_per_round=4",
        "rounds=50",
        "local_epochs=1",
        "time_budget_s=3",
    )
    rows = read_metrics(tmp_path)
    assert rows[-2]["virtual_time_s"] < 3 <= rows[-1]["virtual_time_s"]
    assert len(rows) < 50
