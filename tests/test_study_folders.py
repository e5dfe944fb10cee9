"""Sweep and study folders are data: a planted `best.yaml`, lock link or arm folder neither
widens a sweep, nor silently ends it without its comparison, nor shows up in it."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from conftest import fl_run_cmd, python_run

from fl.run.compare import main as compare_main
from fl.run.sweep import MANIFEST
from fl.run.tracking import summarize
from fl.run.tune import Tuning, check_report, tune_arm

SPACE = {"lr": "choice(0.1,0.3,1.0)"}
GOOD = {"value": 0.8, "overrides": ["lr=0.3"]}


@pytest.mark.parametrize(
    ("space", "override"),
    [
        ({"lr": "choice(0.1,0.3,1.0)"}, "lr=1.0"),
        ({"lr": "tag(log,interval(0.01,1))"}, "lr=0.05"),
        ({"local_steps": "range(1,10,2)"}, "local_steps=7"),
        ({"strategy": "choice(fedavg,apf)"}, "strategy=apf"),
    ],
)
def test_a_value_inside_the_searched_space_is_taken(space, override):
    report = {"value": 0.5, "overrides": [override]}
    assert check_report(report, space) is report


@pytest.mark.parametrize(
    ("report", "message"),
    [
        ({**GOOD, "overrides": ["lr=range(1,100000)"]}, "is not a value of lr"),
        ({**GOOD, "overrides": ["lr=0.1,0.3"]}, "is not a value of lr"),
        ({**GOOD, "overrides": ["lr=0.2"]}, "is not a value of lr"),
        ({**GOOD, "overrides": ["lr=${oc.env:HOME}"]}, "is not a value of lr"),
        ({**GOOD, "overrides": ["lr=0.3", "rounds=100000"]}, "once"),
        ({**GOOD, "overrides": ["hydra.callbacks.x=1"]}, "once"),
        ({**GOOD, "overrides": []}, "once"),
        ({**GOOD, "overrides": "lr=0.3"}, "not a list"),
        ({"overrides": ["lr=0.3"]}, "value: None is not a finite number"),
        ({**GOOD, "value": math.nan}, "not a finite number"),
        ({**GOOD, "value": "0.9"}, "not a finite number"),
        (["lr=0.3"], "not a report"),
    ],
)
def test_a_planted_best_yaml_outside_the_space_is_refused(report, message):
    with pytest.raises(ValueError, match=message):
        check_report(report, SPACE)


def test_interval_and_range_bounds_hold():
    with pytest.raises(ValueError):
        check_report({"value": 1, "overrides": ["lr=2"]}, {"lr": "interval(0.01,1)"})
    with pytest.raises(ValueError):
        check_report({"value": 1, "overrides": ["k=4"]}, {"k": "range(1,10,2)"})
    with pytest.raises(ValueError):
        check_report({"value": 1, "overrides": ["k=true"]}, {"k": "choice(1,2)"})


@pytest.mark.parametrize(
    "text",
    ["value: [unclosed\n", "overrides: [lr=0.3]\n", "{value: 1, overrides: [lr=range(1,9)]}\n"],
)
def test_tune_refuses_a_bad_best_yaml_in_one_line(tmp_path, text):
    block = {"arms": {"a": []}, "space": SPACE, "trials": 1, "seeds": [0]}
    spec = Tuning(block, "x")
    best = tmp_path / "tune" / "a" / "best.yaml"
    best.parent.mkdir(parents=True)
    best.write_text(text)
    with pytest.raises(SystemExit) as err:
        tune_arm(spec, [], "a", tmp_path, 1)  # best.yaml exists: no study runs
    line = str(err.value)
    assert line.startswith(f"fl.run.tune: {best}: ") and "\n" not in line


TINY = ["num_clients=4", "clients_per_round=2", "rounds=1", "local_epochs=1", "plots=false"]


def _plant_arm(sweep, victim_text="planted"):
    """A numbered folder with an edited summary, as an attacker would drop one in."""
    arm = sweep / "5"
    (arm / ".hydra").mkdir(parents=True)
    row = {"round": 1, "accuracy": 0.99, "loss": 0.0, "bytes_up": 1, "bytes_down": 1}
    row |= {"cum_bytes_up": 1, "cum_bytes_down": 1, "virtual_time_s": 1.0, "wall_time_s": 1.0}
    row |= {"cum_payload_bytes_up": 1, "cum_payload_bytes_down": 1}
    (arm / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (arm / "summary.json").write_text(json.dumps(summarize([row], None)))
    (arm / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["seed=99"]))


def test_a_planted_lock_link_and_arm_folder_change_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    sweep.mkdir()
    (sweep / f".{MANIFEST}.lock").symlink_to(victim)
    _plant_arm(sweep)
    proc = python_run(fl_run_cmd("-m", f"hydra.sweep.dir={sweep}", *TINY, "seed=0,1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert victim.read_text() == "keep\n"
    assert not (sweep / f".{MANIFEST}.lock").is_symlink()
    comparison = (sweep / "comparison.md").read_text()
    assert "seed=0" in comparison and "seed=1" in comparison
    assert "seed=99" not in comparison and "0.99" not in comparison
    manifest = json.loads((sweep / MANIFEST).read_text())
    assert sorted(manifest["launched"]) == ["0", "1"] and manifest["compared"] == 2
    # comparing the sweep folder again by hand takes the same arms
    assert compare_main([str(sweep), "--out", str(tmp_path / "again")]) == 0
    again = (tmp_path / "again" / "comparison.md").read_text()
    assert "seed=1" in again and "seed=99" not in again


@pytest.mark.parametrize("name", ["comparison.md", "multirun.yaml"])
def test_a_sweep_refuses_a_link_among_its_files_in_one_line(tmp_path, name):
    sweep = tmp_path / "sweep"
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    sweep.mkdir()
    (sweep / name).symlink_to(victim)
    proc = python_run(fl_run_cmd("-m", f"hydra.sweep.dir={sweep}", *TINY, "seed=0"))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("fl-run: sweep: ") and f"{name} is a symbolic link" in line
    assert victim.read_text() == "keep\n"
