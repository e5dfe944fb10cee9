"""Sweeps beyond one process: Hydra's launchers, resumed sweeps, Optuna studies, tuned presets.

Every launcher gives the basic launcher's numbers arm for arm; the comparison is written by
whichever arm ends last; a sweep killed half-way is completed by `resume=true` without
rerunning a finished arm; a study tunes on a validation split and resumes from its SQLite
file; `python -m fl.run.tune` tunes every arm alike and compares the tuned arms over seeds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, fl_env, fl_run_cmd, python_run, read_metrics, without_wall_time
from netns import require_netns

from fl.common.config import ConfigError, compose
from fl.run.compare import find_runs, seed_arms
from fl.run.validation import validate

TINY = [
    "num_clients=4",
    "clients_per_round=4",
    "rounds=3",
    "local_steps=2",
    "plots=false",
    "progress=false",
]
ARMS = ["strategy=fedavg,fedprox", "seed=0"]


def _sweep(sweep_dir: Path, *overrides: str, timeout: float = 300) -> str:
    proc = python_run(
        [sys.executable, "-m", "fl.run", "-m", *TINY, *overrides, f"hydra.sweep.dir={sweep_dir}"],
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _arms(sweep_dir: Path) -> dict[str, list[dict]]:
    """Each finished arm's metrics (wall time removed), by job number."""
    return {
        d.name: without_wall_time(read_metrics(d))
        for d in sorted(sweep_dir.iterdir())
        if d.name.isdigit() and (d / "summary.json").exists()
    }


@pytest.fixture(scope="module")
def basic(tmp_path_factory) -> Path:
    """The reference: the two-arm sweep on Hydra's basic (sequential, in-process) launcher."""
    sweep_dir = tmp_path_factory.mktemp("basic")
    _sweep(sweep_dir, *ARMS)
    return sweep_dir


def _same_sweep(sweep_dir: Path, reference: Path) -> None:
    arms = _arms(sweep_dir)
    assert list(arms) == ["0", "1"]
    assert arms == _arms(reference)
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert sorted(manifest.pop("launched")) == ["0", "1"]  # the arms it compares
    assert manifest == {"arms": 2, "compared": 2}
    table = (sweep_dir / "comparison.md").read_text()
    assert "strategy=fedavg" in table and "strategy=fedprox" in table


def test_joblib_runs_arms_in_parallel_with_the_basic_launchers_numbers(basic, tmp_path):
    out = _sweep(tmp_path, *ARMS, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    _same_sweep(tmp_path, basic)
    assert out.count("comparison written to") == 1  # by the last arm; the driver sees it done


def test_submitit_local_gives_the_basic_launchers_numbers(basic, tmp_path):
    _sweep(tmp_path, *ARMS, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10")
    _same_sweep(tmp_path, basic)
    assert list((tmp_path / ".submitit").iterdir()), "submitit ran the arms as its jobs"


@pytest.mark.integration
def test_the_ray_launcher_gives_the_basic_launchers_numbers(basic, tmp_path):
    """A local Ray head, started by the launcher inside a loopback-only network namespace
    (Ray probes a public address at start) and a PID namespace (every Ray process ends
    with the test)."""
    require_netns()
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    user = [] if os.geteuid() == 0 else ["-r"]
    namespaces = ["unshare", *user, "-n", "-p", "-f", "--mount-proc"]
    command = [
        sys.executable,
        "-m",
        "fl.run",
        "-m",
        *TINY,
        *ARMS,
        "hydra/launcher=ray",
        "+hydra.launcher.ray.init.num_cpus=2",
        f"+hydra.launcher.ray.init._temp_dir={ray_tmp}",
        "+hydra.launcher.ray.init.include_dashboard=false",
        f"hydra.sweep.dir={tmp_path}",
    ]
    try:
        proc = subprocess.run(
            [*namespaces, "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command],
            cwd=REPO,
            env=fl_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _same_sweep(tmp_path, basic)


def test_a_sweep_killed_half_way_is_completed_by_resume_without_rerunning_finished_arms(
    tmp_path,
):
    long = ["rounds=40", "local_steps=1", "seed=0,1,2"]
    reference = tmp_path / "reference"
    _sweep(reference, *long)
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "fl.run", "-m", *TINY, *long, f"hydra.sweep.dir={killed}"]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=fl_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    try:  # kill the sweep once its second arm has checkpointed a round
        while not (killed / "1" / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended early"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert (killed / "0" / "summary.json").exists()
    assert not (killed / "1" / "summary.json").exists() and not (killed / "2").exists()
    first = (killed / "0" / "metrics.jsonl").read_bytes()

    out = _sweep(killed, *long, "resume=true")
    assert _arms(killed) == _arms(reference)  # as if never interrupted
    assert (killed / "0" / "metrics.jsonl").read_bytes() == first
    assert "resumed from round 40" in (killed / "0" / "run.log").read_text()  # nothing rerun
    assert "holds no run yet: starting this arm" in out  # the arm never started
    assert len(_arms(killed)) == 3 and (killed / "comparison.md").exists()
    # the arm the resume started is labelled as the one the first command would have run:
    # its saved command line leaves out resume=true, and old ones that kept it are read so
    assert "resume" not in (killed / "2" / ".hydra" / "overrides.yaml").read_text()
    labels = set(seed_arms(find_runs(reference)))
    assert set(seed_arms(find_runs(killed))) == labels
    saved = killed / "2" / ".hydra" / "overrides.yaml"
    saved.write_text(saved.read_text() + "- resume=true\n")  # as fl-run saved it before
    assert set(seed_arms(find_runs(killed))) == labels


def test_an_optuna_study_tunes_on_validation_and_resumes_from_its_sqlite_file(tmp_path):
    import optuna

    study = [
        "hydra/sweeper=optuna",
        "hydra.sweeper.sampler=grid",
        "lr=choice(0.1,0.3)",
        "evaluate_on=validation",
    ]
    _sweep(tmp_path, *study, "hydra.sweeper.n_trials=1")
    assert sorted(d.name for d in tmp_path.iterdir() if d.name.isdigit()) == ["0"]
    # a study killed mid-trial leaves that trial running: it is closed, and not counted
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    optuna.load_study(study_name="fl", storage=storage).ask()
    _sweep(tmp_path, *study, "hydra.sweeper.n_trials=2")
    trials = optuna.load_study(study_name="fl", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert [t.params for t in trials] == [{"lr": 0.1}, {}, {"lr": 0.3}]
    summaries = {d: json.loads((tmp_path / d / "summary.json").read_text()) for d in ("0", "2")}
    assert all(s["evaluated_on"] == "validation" for s in summaries.values())
    assert [t.value for t in trials if t.value is not None] == [
        summaries["0"]["final_accuracy"],
        summaries["2"]["final_accuracy"],
    ]
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    winner = max(summaries, key=lambda d: summaries[d]["final_accuracy"])
    assert best["value"] == summaries[winner]["final_accuracy"]
    assert best["overrides"] == [f"lr={ {'0': 0.1, '2': 0.3}[winner] }"]


def test_a_trial_that_misses_the_target_does_not_count_and_does_not_stop_the_study(tmp_path):
    # time to target: lr 1e-6 never reaches 0.3 (no value, not a crash), lr 0.3 does
    study = [
        "hydra/sweeper=optuna",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.objective=time_to_target_s",
        "hydra.sweeper.direction=minimize",
        "target_accuracy=0.3",
        "target_window=1",
        "lr=choice(0.000001,0.3)",
    ]
    out = _sweep(tmp_path, *study)
    assert "trial 0 reported no time_to_target_s" in out
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["overrides"] == ["lr=0.3"] and best["trials_completed"] == 1


def test_a_tuned_preset_tunes_every_arm_alike_then_compares_them_over_seeds(tmp_path):
    command = [
        sys.executable,
        "-m",
        "fl.run.tune",
        "experiment=apf_vs_fedavg_tuned_quick",
        "--out",
        str(tmp_path),
    ]
    proc = python_run(command, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for arm, strategy in (("fedavg", "fedavg"), ("apf", "apf")):
        study = tmp_path / "tune" / arm
        trials = [d for d in study.iterdir() if d.name.isdigit()]
        assert len(trials) == 2  # the same budget: the whole grid, lr 0.1 and 0.3
        values = {
            yaml.safe_load((d / "config.yaml").read_text())["lr"]: json.loads(
                (d / "summary.json").read_text()
            )
            for d in trials
        }
        assert sorted(values) == [0.1, 0.3]
        assert all(s["evaluated_on"] == "validation" for s in values.values())
        chosen = max(values, key=lambda lr: values[lr]["final_accuracy"])
        best = yaml.safe_load((study / "best.yaml").read_text())
        assert best["overrides"] == [f"lr={chosen}"]
        final = tmp_path / "final" / arm
        for seed, run in enumerate(sorted(d for d in final.iterdir() if d.name.isdigit())):
            config = yaml.safe_load((run / "config.yaml").read_text())
            assert (config["strategy"]["name"], config["lr"], config["seed"]) == (
                strategy,
                chosen,
                seed,
            )
            assert json.loads((run / "summary.json").read_text())["evaluated_on"] == "test"
    assert "| fedavg |" in (tmp_path / "tuning.md").read_text()
    assert len((tmp_path / "comparison.md").read_text().split("| strategy=")) == 1 + 4 + 2 + 1

    before = {p: p.read_bytes() for p in tmp_path.rglob("metrics.jsonl")}
    again = python_run(command, timeout=600)  # the same command resumes: nothing to run
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert {p: p.read_bytes() for p in tmp_path.rglob("metrics.jsonl")} == before


def test_fl_run_refuses_a_tuned_preset_in_one_line():
    cfg = compose(["experiment=apf_vs_fedavg_tuned"])
    with pytest.raises(ConfigError, match=r"run it with python -m fl.run.tune"):
        validate(cfg)
    proc = python_run(fl_run_cmd("experiment=apf_vs_fedavg_tuned"), timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("fl-run: invalid config: tuning")


def test_a_validation_split_is_held_out_of_train_and_the_test_split_is_never_used():
    from fl.world.task import get_task

    test_task = get_task(compose(["task=digits"]))
    cfg = compose(["task=digits", "evaluate_on=validation", "validation_fraction=0.2"])
    validate(cfg)
    task = get_task(cfg)
    full, data = test_task.dataset, task.dataset
    n = len(full.y_train)
    assert len(data.y_test) == math.ceil(0.2 * n) and len(data.y_train) == n - len(data.y_test)
    # every evaluated sample is a train sample of the test run, none of its test samples
    train_rows = {row.tobytes() for row in full.x_train.numpy()}
    test_rows = {row.tobytes() for row in full.x_test.numpy()}
    held = {row.tobytes() for row in data.x_test.numpy()}
    assert held <= train_rows and not held & test_rows
    assert not held & {row.tobytes() for row in data.x_train.numpy()}
    # stratified: each class keeps its share
    shares = np.bincount(data.y_test.numpy(), minlength=10) / len(data.y_test)
    assert np.abs(shares - np.bincount(full.y_train.numpy()) / n).max() < 0.02
    assert sum(len(p) for p in task.partitions) == len(data.y_train)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["evaluate_on=valid"], "must be one of"),
        (["evaluate_on=validation", "validation_fraction=0.9"], r"in \(0, 0.5\]"),
        (
            ["task=synthetic", "partition=natural", "evaluate_on=validation"],
            "needs a train split to hold out from",
        ),
    ],
)
def test_a_bad_validation_setting_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides))
