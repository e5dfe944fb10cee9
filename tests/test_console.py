"""What a person watching a run sees: the per-round table, the final line, Flower's logs once."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
from conftest import python_run
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from fl.common.config import CONF_DIR
from fl.run.console import RoundReporter, flower_logs_once, human_bytes, human_seconds

ROW = {
    "round": 3,
    "accuracy": 0.91234,
    "loss": 0.3456,
    "bytes_up": 76_960,
    "bytes_down": 1_540_000,
    "round_time_s": 1.0185,
    "virtual_time_s": 12.53,
    "failed": 1,
    "missing": 2,
    "rejected": 3,
}
SUMMARY = {
    "rounds": 3,
    "final_accuracy": 0.91234,
    "best_accuracy": 0.92,
    "total_bytes_up": 230_880,
    "total_bytes_down": 4_620_000,
    "virtual_time_s": 12.53,
}
DP_NOISE_LINE = "aggregate_fit: central DP noise with"  # one per round from Flower's wrapper


def _report(*rows: dict, summary: dict | None = None) -> list[str]:
    out = io.StringIO()
    reporter = RoundReporter(10, 2, "fedavg", enabled=True, stream=out)
    for row in rows:
        reporter.round_done(row)
    reporter.close(summary or {}, Path("outputs/x"))
    return out.getvalue().splitlines()


def test_units_are_human():
    assert [human_bytes(n) for n in (999, 76_960, 1_540_000, 2.5e9)] == [
        "999 B",
        "77.0 kB",
        "1.5 MB",
        "2.5 GB",
    ]
    assert [human_seconds(s) for s in (1.0185, 12.53, 1499.96)] == ["1.02 s", "12.5 s", "1500.0 s"]


def test_table_shows_units_and_failed_missing_rejected_counts():
    header, line = _report(ROW)
    assert header.split() == [
        "round",
        "accuracy",
        "loss",
        "up",
        "down",
        "round",
        "time",
        "virtual",
        "time",
        "failed",
        "missing",
        "rejected",
    ]
    cells = ["3", "0.9123", "0.3456", "77.0 kB", "1.5 MB", "1.02 s", "12.5 s", "1", "2", "3"]
    assert line.split() == " ".join(cells).split()
    assert len(header) == len(line)  # cells sit under their headers


def test_epsilon_column_appears_when_privacy_reports_it():
    header, first, second = _report(ROW | {"epsilon_max": 2.3456}, ROW | {"epsilon_max": None})
    assert header.split()[-2:] == ["ε", "max"]
    assert first.split()[-1] == "2.35" and second.split()[-1] == "-"
    assert "ε" not in _report(ROW)[0]


def test_final_line_says_when_the_target_was_reached():
    reached = SUMMARY | {"target_accuracy": 0.9, "rounds_to_target": 2, "time_to_target_s": 8.4}
    (line,) = _report(summary=reached)
    assert line.startswith("final accuracy 0.9123 (best 0.9200) after 3 rounds; 12.5 s virtual")
    assert "230.9 kB up, 4.6 MB down" in line
    assert "target 0.9 reached in round 2 at 8.40 s" in line and line.endswith("in outputs/x")
    missed = SUMMARY | {"target_accuracy": 0.99, "rounds_to_target": None, "time_to_target_s": None}
    assert "target 0.99 not reached" in _report(summary=missed)[0]
    assert "target" not in _report(summary=SUMMARY)[0]


def test_disabled_reporter_prints_nothing():
    out = io.StringIO()
    reporter = RoundReporter(3, 0, "fedavg", enabled=False, stream=out)
    reporter.round_done(ROW)
    reporter.close(SUMMARY, Path("x"))
    assert out.getvalue() == ""


@pytest.fixture(scope="module")
def central_dp_run(tmp_path_factory) -> tuple[Path, str]:
    """A privacy=central run with progress on and its output piped (no terminal)."""
    run_dir = tmp_path_factory.mktemp("central") / "run"
    cmd = [sys.executable, "-m", "fl.run", f"hydra.run.dir={run_dir}", "progress=true"]
    args = ["privacy=central", "num_clients=4", "clients_per_round=4", "rounds=2"]
    proc = python_run([*cmd, *args, "local_epochs=1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc.stdout + proc.stderr


def test_piped_output_is_plain_table_lines(central_dp_run):
    run_dir, output = central_dp_run
    assert "\r" not in output and "%|" not in output and "it/s" not in output  # no tqdm frames
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["round", "accuracy"])
    rounds = [line.split() for line in lines[header + 1 :] if line.split()[:1] in (["1"], ["2"])]
    assert [r[0] for r in rounds] == ["1", "2"] and all("kB" in r for r in rounds)
    assert lines[-1].startswith("final accuracy") and lines[-1].endswith(str(run_dir))
    assert not (run_dir / "comparison.md").exists()  # a single run is no sweep


def test_flower_log_lines_appear_once(central_dp_run):
    run_dir, output = central_dp_run
    assert output.count(DP_NOISE_LINE) == 2  # two rounds; was 4 (Flower's console + Hydra's)
    assert (run_dir / "run.log").read_text().count(DP_NOISE_LINE) == 2  # and in the job log


@pytest.fixture
def hydra_logging():
    """Hydra's config of this repo (flwr at INFO) as if fl-run were running; undone after."""
    flower = logging.getLogger("flwr")
    handlers, level = list(flower.handlers), flower.level
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        HydraConfig.instance().set_config(compose("config", return_hydra_config=True))
    yield flower
    HydraConfig.instance().cfg = None
    flower.handlers[:] = handlers
    flower.setLevel(level)


def test_flower_logs_go_through_hydra_once_at_its_level(hydra_logging, caplog):
    from flwr.supercore.logger import console_handler

    hydra_logging.setLevel(logging.DEBUG)  # what importing flwr does
    flower_logs_once()
    assert console_handler not in hydra_logging.handlers
    assert hydra_logging.level == logging.INFO  # hydra.job_logging.loggers.flwr.level
    with caplog.at_level(logging.DEBUG):
        hydra_logging.info("seen")
        hydra_logging.debug("hidden")
    assert [r.getMessage() for r in caplog.records if r.name == "flwr"] == ["seen"]
