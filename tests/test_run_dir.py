"""Run directories are never overwritten or mixed: refusals, safe resumes, corrupt files."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, fl_run_cmd, python_run, read_metrics, run_fl, without_wall_time

from fl.run.checkpoint import CheckpointError, check_resumable, load_checkpoint

# Stateful on both sides (APF: freezing state on the server, synced copies on clients).
RUN = [
    "num_clients=4",
    "clients_per_round=3",
    "local_epochs=1",
    "system=heterogeneous",
    "strategy=apf",
    "strategy.ema_alpha=0.5",
    "strategy.threshold=0.3",
]


def _fl(run_dir: Path, *overrides: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    args = [f"hydra.run.dir={run_dir}"] if run_dir else []
    return python_run(fl_run_cmd(*args, *overrides), cwd=cwd)


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The refusal message; the run must have failed with no traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    return proc.stderr.strip().splitlines()[-1]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != "run.log"
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A 3-round run (to resume from) and the uninterrupted 5-round run it must match."""
    root = tmp_path_factory.mktemp("runs")
    run_fl(root / "three", *RUN, "rounds=3")
    # the reference in a new interpreter: forked resumes must match it (own hash seed)
    run_fl(root / "five", *RUN, "rounds=5", fresh=True)
    return root


def _copy(runs: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs / "three", tmp_path / "run"))


def _assert_matches_five(run_dir: Path, runs: Path) -> None:
    expected = without_wall_time(read_metrics(runs / "five"))
    assert without_wall_time(read_metrics(run_dir)) == expected
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 5
    assert summary["best_accuracy"] == max(r["accuracy"] for r in expected)
    assert (run_dir / "model.pt").read_bytes() == (runs / "five" / "model.pt").read_bytes()


def test_a_run_prints_its_directory_first_and_refuses_to_overwrite_another(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    before = _files(run_dir)
    proc = _fl(run_dir, *RUN, "rounds=2")
    message = _one_line_error(proc)
    assert f"{run_dir} already holds a run" in message and "resume=true" in message
    assert _files(run_dir) == before  # nothing written, not even Hydra's .hydra/ copy

    proc = _fl(run_dir, *RUN, "rounds=2", "overwrite=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == f"fl-run: run directory {run_dir}"
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2]
    assert (run_dir / "checkpoint.prev.pt").read_bytes() != before["checkpoint.prev.pt"]
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    # this run's command line, not the replaced one's; overwrite=true said how this
    # invocation treated the folder, not what the run is
    assert "rounds=2" in overrides and not any(o.startswith("overwrite") for o in overrides)


def test_resume_with_another_strategy_is_refused_before_anything_is_written(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    before = _files(run_dir)
    fedavg = [o for o in RUN if not o.startswith("strategy")]
    message = _one_line_error(_fl(run_dir, *fedavg, "strategy=fedavg", "rounds=5", "resume=true"))
    assert "cannot resume" in message
    assert "strategy.name: 'apf' -> 'fedavg'" in message
    assert _files(run_dir) == before


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("num_clients=5", "num_clients: 4 -> 5"),
        ("seed=1", "seed: 0 -> 1"),
        ("task.model=logreg", "task.model: 'mlp' -> 'logreg'"),
        ("partition=iid", "partition.scheme: 'dirichlet' -> 'iid'"),
        ("strategy.threshold=0.2", "strategy.threshold: 0.3 -> 0.2"),
        ("lr=0.1", "lr: 0.3 -> 0.1"),
    ],
)
def test_a_config_change_is_refused_naming_the_key_and_both_values(runs, override, key):
    from fl.common.config import compose, plain

    saved = load_checkpoint(runs / "three" / "checkpoint.pt")["config"]
    current = plain(compose([*RUN, "rounds=3", override, f"output_dir={runs / 'three'}"]))
    with pytest.raises(CheckpointError, match="cannot resume") as err:
        check_resumable(saved, current)
    assert key in str(err.value)


def test_extending_a_run_continues_it_exactly(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    proc = _fl(run_dir, *RUN, "rounds=5", "resume=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    _assert_matches_five(run_dir, runs)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_checkpoint_resumes_from_the_previous_one(runs, tmp_path, damage):
    run_dir = _copy(runs, tmp_path)
    newest = run_dir / "checkpoint.pt"
    data = newest.read_bytes()
    newest.write_bytes(
        {"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"x" * 99}[damage]
    )
    if damage == "truncated":  # end to end: same metrics as the uninterrupted run
        proc = _fl(run_dir, *RUN, "rounds=5", "resume=true")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "checkpoint.pt is unusable" in proc.stdout
        _assert_matches_five(run_dir, runs)
    else:
        assert load_checkpoint(newest)["progress"]["round"] == 2


def test_with_no_usable_checkpoint_resume_says_so_in_one_line(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    (run_dir / "checkpoint.pt").write_bytes(b"")
    (run_dir / "checkpoint.prev.pt").write_bytes(b"\x80\x04garbage")
    message = _one_line_error(_fl(run_dir, *RUN, "rounds=5", "resume=true"))
    assert message.startswith(f"fl-run: no usable checkpoint in {run_dir}: checkpoint.pt: ")
    assert "checkpoint.prev.pt: " in message


class _Exploit:
    """Unpickling this with full pickle would create a file: proof of code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_checkpoint_does_not_execute_code(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    marker = tmp_path / "pwned"
    payload = {"progress": _Exploit(marker), "arrays": {}, "config": {}}
    torch.save(payload, run_dir / "checkpoint.pt")
    with (run_dir / "checkpoint.prev.pt").open("wb") as f:
        pickle.dump(_Exploit(marker), f)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(run_dir / "checkpoint.pt")
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["torn last line", "missing"])
def test_metrics_file_damage_does_not_falsify_a_resume(runs, tmp_path, damage):
    run_dir = _copy(runs, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    if damage == "missing":
        metrics.unlink()
    else:
        text = metrics.read_text()
        metrics.write_text(text + text.splitlines()[-1][:40])  # killed mid-write of a 4th row
    proc = _fl(run_dir, *RUN, "rounds=5", "resume=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    _assert_matches_five(run_dir, runs)


def test_resume_latest_finds_the_killed_run_and_its_settings(tmp_path):
    small = ["num_clients=3", "clients_per_round=3", "local_epochs=1"]
    first = _fl(None, *small, "rounds=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir,) = {p.parent for p in (tmp_path / "outputs").glob("*/*/checkpoint.pt")}
    again = _fl(None, "resume=latest", "rounds=3", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"fl-run: resuming {run_dir}" in again.stdout
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[-1]["clients"] == 3


def test_resume_latest_without_any_run_says_so(tmp_path):
    message = _one_line_error(_fl(None, "resume=latest", cwd=tmp_path))
    assert message == "fl-run: resume=latest: no run with a checkpoint under outputs/"


def test_version_prints_the_project_version():
    from importlib.metadata import version

    proc = python_run([sys.executable, "-m", "fl.run", "--version"], timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"adaptive-fl {version('adaptive-fl')} (flwr 1.42")


@pytest.fixture
def small_run(tmp_path) -> Path:
    """A finished 1-round run under tmp_path/outputs, found by resume=latest."""
    first = _fl(
        None, "num_clients=3", "clients_per_round=3", "local_epochs=1", "rounds=1", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir,) = {p.parent for p in (tmp_path / "outputs").glob("*/*/checkpoint.pt")}
    return run_dir


@pytest.mark.parametrize(
    "planted",
    [
        ["+hydra.callbacks.evil._target_=os.makedirs", "+hydra.callbacks.evil.name={marker}"],
        ["--config-dir={marker}"],
        ["experiment@hydra=smoke"],
    ],
)
def test_resume_latest_replays_nothing_but_the_runs_own_keys(small_run, tmp_path, planted):
    marker = tmp_path / "code-ran"
    overrides = small_run / ".hydra" / "overrides.yaml"
    saved = yaml.safe_load(overrides.read_text())
    overrides.write_text(yaml.safe_dump([*saved, *(p.format(marker=marker) for p in planted)]))
    message = _one_line_error(_fl(None, "resume=latest", "rounds=2", cwd=tmp_path))
    assert message.startswith(f"fl-run: resume=latest: {small_run}: ")
    assert "is not an override of the run's own keys" in message
    assert not marker.exists()
    assert [r["round"] for r in read_metrics(small_run)] == [1]  # the run was not touched


def test_resume_latest_needs_a_checkpoint_that_loads(small_run, tmp_path):
    (small_run / "checkpoint.pt").write_bytes(b"garbage")
    (small_run / "checkpoint.prev.pt").unlink(missing_ok=True)
    message = _one_line_error(_fl(None, "resume=latest", cwd=tmp_path))
    assert message.startswith(f"fl-run: resume=latest: {small_run}: no usable checkpoint")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_run_file_that_is_not_a_regular_file_is_refused_before_any_round(tmp_path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    checkpoint = run_dir / "checkpoint.pt"
    os.mkfifo(checkpoint) if kind == "fifo" else checkpoint.mkdir()
    for resume in ("resume=true", "overwrite=true"):
        message = _one_line_error(_fl(run_dir, "rounds=1", resume))
        what = "a FIFO" if kind == "fifo" else "a directory"
        assert message == f"fl-run: {checkpoint} is {what}, not a regular file"
    assert not (run_dir / "metrics.jsonl").exists()


def _nan_model(saved):
    name = next(iter(saved["arrays"]))
    saved["arrays"][name] = torch.full_like(saved["arrays"][name], float("nan"))


def _apf_state(saved) -> dict:
    """APF's own state attributes in a checkpoint (not the kernel's sync and nonces)."""
    from strategies.apf import APFServer

    return {k: saved["strategy"][k] for k in APFServer.state_attributes}


def _wrong_shape(saved):
    name = next(iter(saved["arrays"]))
    saved["arrays"][name] = torch.zeros(3)


TAMPERED = {
    "round of the wrong type": (lambda s: s["progress"].update(round="3"), "round '3'"),
    "round 10^12": (lambda s: s["progress"].update(round=10**12), "round 1000000000000"),
    "clock of -1e300": (lambda s: s["progress"].update(virtual_time_s=-1e300), "virtual_time_s"),
    "NaN model": (_nan_model, "is not finite"),
    "wrong tensor shape": (_wrong_shape, "is not torch.float32"),
    "bad RNG state": (lambda s: s["rng"].update(torch=torch.zeros(3)), "does not fit this run"),
    "strategy state without its sync": (lambda s: s["strategy"].pop("sync"), "does not fit"),
    "strategy state of the wrong kind": (
        lambda s: s["strategy"].update({next(iter(_apf_state(s))): "junk"}),
        "is str, not",
    ),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_checkpoint_whose_contents_do_not_fit_is_refused_in_one_line(runs, tmp_path, case):
    run_dir = _copy(runs, tmp_path)
    saved = load_checkpoint(run_dir / "checkpoint.pt")
    tamper, message = TAMPERED[case]
    tamper(saved)
    (run_dir / "checkpoint.prev.pt").unlink(missing_ok=True)
    (run_dir / "checkpoint.pt").unlink()
    from fl.run.checkpoint import save_checkpoint

    save_checkpoint(run_dir / "checkpoint.pt", saved)
    rows_before = (run_dir / "metrics.jsonl").read_bytes()
    line = _one_line_error(_fl(run_dir, *RUN, "rounds=5", "resume=true"))
    assert line.startswith("fl-run: checkpoint: ") and message in line, line
    assert (run_dir / "metrics.jsonl").read_bytes() == rows_before


def test_a_run_killed_before_its_first_checkpoint_starts_again_on_resume(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    for name in ("checkpoint.pt", "checkpoint.prev.pt", "summary.json", "model.pt"):
        (run_dir / name).unlink(missing_ok=True)
    (run_dir / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    proc = _fl(run_dir, *RUN, "rounds=5", "resume=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no checkpoint yet: the run starts again at round 1" in proc.stdout + proc.stderr
    _assert_matches_five(run_dir, runs)


def test_resume_of_a_folder_without_any_run_still_says_there_is_nothing(tmp_path):
    message = _one_line_error(_fl(tmp_path / "empty", "resume=true"))
    assert "no checkpoint at" in message
