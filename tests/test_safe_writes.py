"""Nothing the project writes goes through a link: every writer, with a planted symlink.

Each case plants a link (into a "victim" file outside the run directory, as an attacker
would point one at a shell start-up file) where a writer is about to write, and asserts the
write is refused in one line naming the link, and the victim is untouched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import fl_run_cmd, python_run, run_fl
from omegaconf import OmegaConf

from fl.common.files import NotRegularFile, make_dir, open_for_append, write_atomic
from fl.run.checkpoint import CHECKPOINT, PREVIOUS, history_path, load_checkpoint, save_checkpoint
from fl.run.tracking import summarize

VICTIM_TEXT = "echo harmless\n"
ROW = {"round": 1, "accuracy": 0.5, "loss": 1.0, "bytes_up": 1, "bytes_down": 1}
ROW |= {"cum_bytes_up": 1, "cum_bytes_down": 1, "virtual_time_s": 1.0, "wall_time_s": 1.0}
ROW |= {"cum_payload_bytes_up": 1, "cum_payload_bytes_down": 1}


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the run directory that a planted link points at."""
    path = tmp_path / "outside" / ".bashrc"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def _plant(link: Path, victim: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)


def _untouched(victim: Path) -> None:
    assert victim.read_text() == VICTIM_TEXT


def test_write_atomic_writes_and_replaces_a_stale_temporary(tmp_path):
    path = tmp_path / "out.json"
    (tmp_path / "out.json.tmp").write_text("left by a kill")
    write_atomic(path, "one\n")
    write_atomic(path, b"two\n")
    write_atomic(path, lambda f: f.write(b"three\n"))
    assert path.read_text() == "three\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


@pytest.mark.parametrize("where", ["target", "temporary", "previous"])
def test_write_atomic_refuses_a_link_at_any_name_it_writes(tmp_path, victim, where):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")
    link = {"target": path, "temporary": tmp_path / "checkpoint.pt.tmp"}
    link["previous"] = tmp_path / PREVIOUS
    if where == "target":
        path.unlink()
    _plant(link[where], victim)
    with pytest.raises(NotRegularFile, match=r"symbolic link.*nothing is written") as err:
        write_atomic(path, b"new", keep_previous=PREVIOUS)
    assert str(link[where]) in str(err.value) and "\n" not in str(err.value)
    _untouched(victim)
    assert link[where].is_symlink()
    if where != "target":
        assert path.read_bytes() == b"old"  # nothing lost


def test_write_atomic_refuses_a_fifo_and_a_directory(tmp_path):
    os.mkfifo(tmp_path / "summary.json")
    with pytest.raises(NotRegularFile, match=r"a FIFO"):
        write_atomic(tmp_path / "summary.json", "{}")
    (tmp_path / "model.pt").mkdir()
    with pytest.raises(NotRegularFile, match=r"a directory"):
        write_atomic(tmp_path / "model.pt", b"")


def test_append_and_make_dir_refuse_links(tmp_path, victim):
    _plant(tmp_path / "metrics.jsonl", victim)
    link = tmp_path / "metrics.jsonl"
    with pytest.raises(NotRegularFile, match=r"symbolic link"), open_for_append(link) as f:
        f.write(b"$(touch /tmp/pwned)\n")
    _untouched(victim)
    os.mkfifo(tmp_path / "log")
    with pytest.raises(NotRegularFile, match=r"a FIFO"), open_for_append(tmp_path / "log"):
        pass
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / ".hydra").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NotRegularFile, match=r"not a directory"):
        make_dir(tmp_path / ".hydra")
    with open_for_append(tmp_path / "fine.log") as f:
        f.write(b"a\n")
    with open_for_append(tmp_path / "fine.log") as f:
        f.write(b"b\n")
    assert (tmp_path / "fine.log").read_text() == "a\nb\n"


def test_checkpoint_and_its_history_refuse_links(tmp_path, victim):
    payload = {"config": {"checkpoint_history": True}, "progress": {"round": 1}, "x": 1}
    _plant(tmp_path / "checkpoint.pt.tmp", victim)
    with pytest.raises(NotRegularFile, match=r"checkpoint.pt.tmp is a symbolic link"):
        save_checkpoint(tmp_path / CHECKPOINT, payload)
    (tmp_path / "checkpoint.pt.tmp").unlink()
    (tmp_path / "elsewhere").mkdir()
    history_path(tmp_path, 1).parent.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NotRegularFile, match=r"checkpoints is a symbolic link"):
        save_checkpoint(tmp_path / CHECKPOINT, payload)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    history_path(tmp_path, 1).parent.unlink()
    _plant(history_path(tmp_path, 2), victim)
    with pytest.raises(NotRegularFile, match=r"round-00002.pt is not a regular file"):
        save_checkpoint(tmp_path / CHECKPOINT, {**payload, "progress": {"round": 2}})
    _untouched(victim)


def test_run_log_refuses_links_to_each_of_its_files(tmp_path, victim):
    from fl.run.tracking import RunLog

    cfg = OmegaConf.create({"logger": {"name": "jsonl"}, "strategy": {"name": "fedavg"}})
    for name in ("config.yaml", "metrics.jsonl"):
        run = tmp_path / name
        _plant(run / name, victim)
        with pytest.raises(NotRegularFile, match=f"{name} is a symbolic link"):
            RunLog(run, cfg)
    run = tmp_path / "summary"
    log = RunLog(run, OmegaConf.merge(cfg, {"plots": False}))
    row = dict(ROW)
    (run / "metrics.jsonl").unlink()
    _plant(run / "metrics.jsonl", victim)
    with pytest.raises(NotRegularFile, match=r"metrics.jsonl is a symbolic link"):
        log.append({**row, "note": "$(touch /tmp/pwned)"})
    (run / "metrics.jsonl").unlink()
    log.append(row)
    _plant(run / "summary.json", victim)
    with pytest.raises(NotRegularFile, match=r"summary.json is a symbolic link"):
        log.finish()
    _untouched(victim)


def test_sac_agent_save_back_refuses_a_link(tmp_path, victim):
    from fl.mechanisms.sac import SACConfig, SACDiscrete, check_agent_file

    config = SACConfig(state_dim=3, num_actions=2, hidden=4)
    agent = SACDiscrete(config, 0)
    for name in ("agent.pt", "agent.pt.tmp"):
        _plant(tmp_path / name, victim)
        with pytest.raises(NotRegularFile, match=f"{name} is a symbolic link"):
            check_agent_file(tmp_path / "agent.pt", config, None)  # before any round
        with pytest.raises(NotRegularFile, match=f"{name} is a symbolic link"):
            agent.save(tmp_path / "agent.pt")
        (tmp_path / name).unlink()
    _untouched(victim)
    agent.save(tmp_path / "agent.pt")
    check_agent_file(tmp_path / "agent.pt", config, None)


def test_comparison_plots_and_sweep_manifest_refuse_links(tmp_path, victim):
    from fl.run.compare import compare_runs
    from fl.run.sweep import MANIFEST, _write_manifest

    run = tmp_path / "sweep" / "0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps(ROW) + "\n")
    (run / "summary.json").write_text(json.dumps(summarize([ROW], None)))
    out = tmp_path / "sweep"
    for name in ("comparison.md", "comparison.png"):
        _plant(out / name, victim)
        with pytest.raises(NotRegularFile, match=f"{name} is a symbolic link"):
            compare_runs([run], out, "t")
        (out / name).unlink()
    compare_runs([run], out, "t")
    assert (out / "comparison.md").is_file() and (out / "comparison.png").is_file()
    for name in (f"{MANIFEST}.tmp", MANIFEST):
        _plant(out / name, victim)
        with pytest.raises(NotRegularFile, match=r"symbolic link"):
            _write_manifest(out, {"arms": 1, "compared": 0})
        (out / name).unlink()
    _untouched(victim)


def _one_line(proc) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def test_a_fresh_run_refuses_a_planted_checkpoint_temporary(tmp_path, victim, tiny_overrides):
    run = tmp_path / "run"
    _plant(run / "checkpoint.pt.tmp", victim)
    proc = python_run(fl_run_cmd(f"hydra.run.dir={run}", *tiny_overrides))
    line = _one_line(proc)
    assert "checkpoint.pt.tmp is a symbolic link" in line, line
    _untouched(victim)
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "name", ["metrics.jsonl", "summary.json", "model.pt", "config.yaml", "run.log"]
)
def test_a_resume_refuses_links_among_its_files_and_loses_nothing(
    tmp_path, victim, tiny_overrides, name
):
    run = tmp_path / "run"
    run_fl(run, *tiny_overrides, "rounds=2")
    checkpoint = (run / CHECKPOINT).read_bytes()
    (run / name).unlink()
    _plant(run / name, victim)
    proc = python_run(fl_run_cmd(f"hydra.run.dir={run}", *tiny_overrides, "resume=true"))
    line = _one_line(proc)
    assert f"{name} is a symbolic link" in line, line
    _untouched(victim)
    assert (run / CHECKPOINT).read_bytes() == checkpoint  # the model is not lost
    assert load_checkpoint(run / CHECKPOINT)["progress"]["round"] == 2


def test_the_privacy_cli_refuses_a_link_among_its_outputs(tmp_path, victim):
    import sys

    _plant(tmp_path / "study.md", victim)
    args = ["simulate", "--devices", "4", "--rounds", "2", "--analysts", "2", "--pipelines", "2"]
    args += ["--betas", "1", "--name", "study", "--out", str(tmp_path)]
    proc = python_run([sys.executable, "-m", "privacy.cli", *args])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("privacy.cli: error:") and "study.md is a symbolic link" in line
    _untouched(victim)


def test_the_run_log_handler_writes_nothing_through_a_link(tmp_path, victim):
    import logging

    from fl.common.files import LogFile

    logger = logging.getLogger("test_safe_writes")
    for name in ("run.log", "linked.log"):
        if name == "linked.log":
            _plant(tmp_path / name, victim)
        handler = LogFile(str(tmp_path / name))
        logger.addHandler(handler)
        logger.warning("$(touch /tmp/pwned)")
        logger.removeHandler(handler)
        handler.close()
    assert "$(touch /tmp/pwned)" in (tmp_path / "run.log").read_text()
    _untouched(victim)
