"""Comparison tables of runs and sweeps: the callback every multirun ends with, the CLI."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import python_run

from fl.run.compare import compare_runs, find_runs, main
from fl.run.intervals import interval
from fl.run.tracking import reached_target


def _fake_run(path, label: str, total_up: int, payload_up: int, frozen=None):
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(f"- {label}\n- experiment=x\n")
    rows = []
    for rnd in (1, 2):
        row = {
            "round": rnd,
            "accuracy": 0.5 * rnd,
            "cum_bytes_up": total_up * rnd // 2,
            "cum_bytes_down": 0,
            "virtual_time_s": float(rnd),
        }
        if frozen is not None:
            row["frozen_fraction"] = frozen
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "final_accuracy": 1.0,
        "best_accuracy": 1.0,
        "total_bytes_up": total_up,
        "total_bytes_down": 0,
        "total_payload_bytes_up": payload_up,
        "total_payload_bytes_down": 0,
        "virtual_time_s": 2.0,
    }
    (path / "summary.json").write_text(json.dumps(summary))


def test_table_reports_traffic_relative_to_first_run(tmp_path):
    _fake_run(tmp_path / "0", "strategy=fedavg", 4_000_000, 4_000_000)
    _fake_run(tmp_path / "1", "strategy=apf", 1_100_000, 1_000_000, frozen=0.75)
    table = compare_runs([tmp_path / "0", tmp_path / "1"], tmp_path, "t")
    fedavg, apf = table.splitlines()[2:4]
    assert fedavg.startswith("| strategy=fedavg |") and "| 100.0% |" in fedavg
    assert "| 1.1 | 27.5% | 1.0 | 25.0% |" in apf
    assert apf.endswith("| 0.750 |") and fedavg.endswith("| - |")
    for name in ("comparison.md", "comparison.png", "frozen_fraction.png"):
        assert (tmp_path / name).stat().st_size > 0
    # plots=false (the presets' quick CI variants): the same table, no PNG at all
    quiet = tmp_path / "quiet"
    assert compare_runs([tmp_path / "0", tmp_path / "1"], quiet, "t", plots=False) == table
    assert [p.name for p in quiet.iterdir()] == ["comparison.md"]


def test_table_reports_rounds_and_traffic_to_target(tmp_path):
    _fake_run(tmp_path / "0", "strategy=fedavg", 4_000_000, 4_000_000)
    _fake_run(tmp_path / "1", "strategy=apf", 1_100_000, 1_000_000)
    for name, rounds, hit in (("0", 2, 4_000_000), ("1", None, None)):
        path = tmp_path / name / "summary.json"
        summary = json.loads(path.read_text())
        summary |= {"target_accuracy": 0.9, "rounds_to_target": rounds, "bytes_to_target": hit}
        path.write_text(json.dumps(summary))
    table = compare_runs([tmp_path / "0", tmp_path / "1"], tmp_path, "t")
    header, _, fedavg, apf = table.splitlines()[:4]
    assert "| rounds to 0.9 | MB to 0.9 |" in header
    assert "| 2 | 4.0 |" in fedavg and "| not reached | not reached |" in apf


def _job(path, overrides: list[str], accuracy: float) -> None:
    """A finished run whose summary reports `accuracy`."""
    _fake_run(path, overrides[0], 4_000_000, 4_000_000)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    summary = json.loads((path / "summary.json").read_text())
    summary |= {"final_accuracy": accuracy, "best_accuracy": accuracy}
    (path / "summary.json").write_text(json.dumps(summary))


def _seed_sweep(sweep) -> None:
    for num, (strategy, seed, accuracy) in enumerate(
        [("fedavg", 0, 0.8), ("fedavg", 1, 0.9), ("apf", 0, 0.6), ("apf", 1, 0.7)]
    ):
        _job(sweep / str(num), [f"strategy={strategy}", f"seed={seed}", "rounds=2"], accuracy)


def test_seed_sweep_adds_the_mean_and_its_interval_per_arm(tmp_path):
    _seed_sweep(tmp_path)
    table = compare_runs(find_runs(tmp_path), tmp_path, "t")
    lines = table.splitlines()
    assert lines[2].startswith("| strategy=fedavg seed=0 | 0.8000 |")  # rounds=2: shared, dropped
    assert any(line.startswith("Mean over seeds [95 % t-interval") for line in lines)
    # two seeds: mean ± t(0.975, 1) · s / √2 = 0.85 ± 12.706 · 0.0707 / 1.414, which
    # reaches past accuracy's range: clipped to 1
    assert "| strategy=fedavg | 2 | 0.8500 [0.2147, 1.0000] |" in table
    assert "| strategy=apf | 2 | 0.6500 [0.0147, 1.0000] |" in table


def test_arms_are_paired_with_the_reference_seed_by_seed(tmp_path):
    _seed_sweep(tmp_path)
    times = {"0": 10.0, "1": 20.0, "2": 5.0, "3": 12.0}  # apf/fedavg: 0.5 and 0.6
    for job, time_s in times.items():
        path = tmp_path / job / "summary.json"
        summary = json.loads(path.read_text())
        summary |= {"target_accuracy": 0.5, "rounds_to_target": 1, "time_to_target_s": time_s}
        path.write_text(json.dumps(summary))
    table = compare_runs(find_runs(tmp_path), tmp_path, "t", plots=False)
    assert "Paired with `strategy=fedavg` seed by seed" in table
    # Δ accuracy -0.2 on both seeds (no spread), the same traffic on both; time ratios 0.5,
    # 0.6: 0.55 ± 12.706·0.0707/√2, whose low end (-0.085) is clipped to 0
    assert "| strategy=apf | 2 | -0.2000 [-0.2000, -0.2000] | identical (all 2 seeds) |" in table
    assert "| 0.550 [0.000, 1.185] (2 seeds) |" in table
    other = compare_runs(find_runs(tmp_path), tmp_path, "t", plots=False, reference="strategy=apf")
    assert "| strategy=fedavg | 2 | 0.2000 [0.2000, 0.2000] |" in other
    with pytest.raises(ValueError, match="reference arm 'nope'"):
        compare_runs(find_runs(tmp_path), tmp_path, "t", plots=False, reference="nope")


def test_the_interval_is_students_t_and_one_seed_has_none():
    assert interval([0.8, 0.9]) == pytest.approx((0.85, 0.85 - 0.63531, 0.85 + 0.63531), abs=1e-5)
    values = [1.0, 2.0, 3.0, 4.0, 5.0]  # s = 1.5811, t(0.975, 4) = 2.7764
    assert interval(values) == pytest.approx((3.0, 3.0 - 1.9632, 3.0 + 1.9632), abs=1e-4)
    assert interval([0.7]) == (0.7, 0.7, 0.7)


def test_time_to_target_needs_the_trailing_mean_to_reach_it():
    rows = [
        {"round": r, "accuracy": a}
        for r, a in enumerate([0.5, 0.92, 0.8, 0.9, 0.91, 0.95, 0.93], 1)
    ]
    assert reached_target(rows, 0.9, 1)["round"] == 2  # the first crossing: one lucky round
    assert reached_target(rows, 0.9, 3)["round"] == 6  # mean of rounds 4-6: 0.92
    assert reached_target(rows, 0.99, 3) is None


def test_cli_help():
    proc = python_run([sys.executable, "-m", "fl.run.compare", "--help"], timeout=60)
    assert proc.returncode == 0
    assert "usage: python -m fl.run.compare" in proc.stdout
    assert "--out DIR" in proc.stdout and "--title TEXT" in proc.stdout
    assert "sweep directory" in proc.stdout


def test_cli_expands_a_sweep_dir_and_runs(tmp_path, capsys):
    _seed_sweep(tmp_path / "sweep")
    (tmp_path / "sweep" / "4").mkdir()  # a job that wrote nothing is no run
    assert main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out"), "--title", "T"]) == 0
    text = (tmp_path / "out" / "comparison.md").read_text()
    assert text.startswith("# T\n") and text.count("| strategy=") == 7  # 4 runs, 2 arms, 1 pair
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 0
    runs = [str(tmp_path / "sweep" / "0"), str(tmp_path / "sweep" / "3")]
    assert main([*runs, "--out", str(tmp_path / "two")]) == 0
    assert "| strategy=apf seed=1 |" in (tmp_path / "two" / "comparison.md").read_text()
    assert main([str(tmp_path / "sweep")]) == 0  # default --out: the one DIR given
    assert (tmp_path / "sweep" / "comparison.md").read_text().startswith("# sweep\n")
    capsys.readouterr()


def test_cli_refuses_a_dir_without_runs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no run" in err and str(tmp_path / "empty") in err
