"""experiments/asfl_table.py: ASFL's objective per seed against sync FedAvg's time, paired by
seed with a reference arm, from run folders written here; bad summaries and a seed read
twice are refused, and its JSON fills a scoreboard condition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments import asfl_table, scoreboard


def _run(sweep: Path, job: int, arm: str, seed: int, acc: float, time: float, *extra: str) -> None:
    folder = sweep / str(job)
    (folder / ".hydra").mkdir(parents=True)
    overrides = [f"+experiment/asfl_arm={arm}", *extra, f"seed={seed}"]
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    row = {"round": 1, "virtual_time_s": time, "accuracy": acc, "quota_k": 5, "lag_tolerance": 3}
    (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    summary = {"final_accuracy": acc, "virtual_time_s": time, "time_to_target_s": time / 2}
    (folder / "summary.json").write_text(json.dumps(summary))


def _sweep(tmp_path: Path, seeds=(0, 1, 2), name: str = "sweep") -> Path:
    """FedAvg takes 100 s at 0.9; SAFA 40 s at 0.8; ASFL 30 s at 0.8 + 0.01 × seed."""
    sweep, job = tmp_path / name, 0
    for seed in seeds:
        for arm, acc, time in (
            ("fedavg", 0.9, 100.0),
            ("safa", 0.8, 40.0),
            ("asfl", 0.8 + 0.01 * seed, 30.0),
        ):
            _run(sweep, job, arm, seed, acc, time)
            job += 1
    return sweep


def test_objective_is_paired_by_seed_against_the_reference(tmp_path):
    runs = asfl_table.arm_runs([_sweep(tmp_path)])
    o = asfl_table.objectives(runs, rho=0.5)
    assert o["fedavg"][0] == pytest.approx(0.5 * 0.9 - 0.5)
    assert o["safa"][1] == pytest.approx(0.4 - 0.2)
    figures = asfl_table.paired(o, "safa")
    asfl = figures["arms"]["asfl"]
    # ASFL − SAFA per seed: +0.05 (time) + 0.005 × seed (accuracy)
    assert asfl["objective_deltas"] == pytest.approx([0.05, 0.055, 0.06])
    assert asfl["seeds"] == [0, 1, 2] and asfl["reference"] == "safa"
    assert asfl["mean"] == pytest.approx(0.055)
    assert asfl["lo"] < asfl["mean"] < asfl["hi"]
    assert figures["arms"]["fedavg"]["objective_deltas"] == pytest.approx([-0.25] * 3)


def test_several_sweeps_read_as_one_but_a_seed_read_twice_is_refused(tmp_path):
    first, later = _sweep(tmp_path), _sweep(tmp_path, seeds=(3, 4), name="later")
    runs = asfl_table.arm_runs([first, later])
    assert sorted(runs["asfl"]) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="ran seed 0 twice"):
        asfl_table.arm_runs([first, first])
    # an arm run again with other settings is another arm, labelled by them
    ablation = tmp_path / "ablation"
    _run(ablation, 0, "safa", 0, 0.7, 30.0, "strategy.cfcfm=false")
    runs = asfl_table.arm_runs([first, ablation])
    assert sorted(runs["safa strategy.cfcfm=false"]) == [0] and sorted(runs["safa"]) == [0, 1, 2]


def test_a_summary_out_of_range_is_refused_not_averaged(tmp_path):
    sweep = _sweep(tmp_path)
    bad = sweep / "4" / "summary.json"  # seed 1's SAFA
    bad.write_text(json.dumps({"final_accuracy": 7.0, "virtual_time_s": 40.0}))
    with pytest.raises(ValueError, match=r"final_accuracy 7\.0"):
        asfl_table.objectives(asfl_table.arm_runs([sweep]), rho=0.5)
    bad.write_text(json.dumps({"final_accuracy": 0.8, "virtual_time_s": float("nan")}))
    with pytest.raises(ValueError, match="virtual_time_s nan"):
        asfl_table.objectives(asfl_table.arm_runs([sweep]), rho=0.5)
    bad.write_text(json.dumps({"final_accuracy": True, "virtual_time_s": 40.0}))
    with pytest.raises(ValueError, match="final_accuracy True"):
        asfl_table.objectives(asfl_table.arm_runs([sweep]), rho=0.5)


def test_the_command_prints_writes_json_and_fills_a_scoreboard_condition(tmp_path, capsys):
    out = tmp_path / "vs_safa.json"
    args = [str(_sweep(tmp_path)), "--reference", "safa", "--json", str(out)]
    assert asfl_table.main(args) == 0
    printed = capsys.readouterr().out
    assert "| asfl − safa | 0,1,2 | +0.055 [" in printed
    record = json.loads((scoreboard.RECORDS / "asfl.json").read_text())
    record["conditions"] = [
        {"label": "room: O − SAFA", "arm": "asfl", "reference": "safa"}
        | {"metric": "objective_delta", "rule": "at_least", "bar": 0.0}
        | {"mean": 0.0, "lo": 0.0, "hi": 0.0, "seeds": None}
    ]
    folder = tmp_path / "records"
    folder.mkdir()
    (folder / "asfl.json").write_text(json.dumps(record))
    filled = scoreboard.record_figures([out], "asfl", "cmd", "2026-12-07", folder)
    condition = filled["conditions"][0]
    assert condition["seeds"] == pytest.approx([0.05, 0.055, 0.06])
    assert scoreboard.condition_verdict(condition) == "reproduces"


def test_the_command_names_a_missing_sync_arm_and_refuses_a_preference_out_of_range(
    tmp_path, capsys
):
    sweep = tmp_path / "sweep"
    _run(sweep, 0, "asfl", 0, 0.8, 30.0)
    assert asfl_table.main([str(sweep)]) == 2
    assert "no 'fedavg' arm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        asfl_table.main([str(sweep), "--rho", "1.5"])
    assert "a preference lies in [0, 1]" in capsys.readouterr().err
