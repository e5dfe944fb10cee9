"""Flower's server-side central-DP wrappers around our strategies, end to end through fl-run."""

from __future__ import annotations

import re
import subprocess

import forkrun
import pytest
import torch
from conftest import fl_run_cmd, python_popen, python_run, read_metrics

from fl.common.config import ConfigError, compose
from fl.run.validation import validate
from fl.wire.records import Layout
from fl.world.task import get_task

RUN = ["privacy=central", "num_clients=4", "clients_per_round=4", "rounds=3", "local_epochs=1"]


def _start(run_dir, *overrides: str) -> forkrun.ForkedProcess | subprocess.Popen[str]:
    return python_popen(fl_run_cmd(f"hydra.run.dir={run_dir}", *overrides))


def _finish(proc: forkrun.ForkedProcess | subprocess.Popen[str]) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]


def test_fixed_clipping_bounds_every_round_and_adaptive_clipping_adapts(tmp_path):
    clip = 0.01
    fixed = _start(
        tmp_path / "fixed",
        *RUN,
        "privacy.server_dp.noise_multiplier=0.0",
        f"privacy.server_dp.clipping_norm={clip}",
    )
    adaptive = _start(tmp_path / "adaptive", *RUN, "privacy.server_dp.mode=adaptive")
    _finish(fixed)
    _finish(adaptive)

    # the aggregate of updates clipped to `clip` moves the model by at most `clip` a round
    task = get_task(compose(RUN))
    layout = Layout.of(task.new_model().state_dict())
    start = layout.flatten(task.new_model().state_dict())
    final = layout.flatten(torch.load(tmp_path / "fixed" / "model.pt"))
    moved = float(torch.linalg.vector_norm(final - start))
    assert 0.5 * clip < moved <= 3 * clip * (1 + 1e-5)
    rows = read_metrics(tmp_path / "fixed")
    assert [r["dp_clipping_norm"] for r in rows] == [clip] * 3
    assert all(r["replies"] == 4 and r["rejected"] == 0 for r in rows)

    norms = [r["dp_clipping_norm"] for r in read_metrics(tmp_path / "adaptive")]
    assert norms[0] != pytest.approx(1.0) and len(set(norms)) == 3  # starts at 1.0, then learns


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("privacy.server_dp.mode=secagg", "privacy.server_dp.mode='secagg': must be one of"),
        ("privacy.server_dp.clipping_norm=0", "privacy.server_dp.clipping_norm=0: must be"),
    ],
)
def test_invalid_central_dp_options_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose([*RUN, override]))


def test_fl_run_refuses_apf_under_central_dp_in_one_line_naming_both(tmp_path):
    # APF's clients keep the frozen scalars the server never resends: central DP's noise
    # on them would leave clients and server with different models
    proc = python_run(fl_run_cmd(f"hydra.run.dir={tmp_path}", "strategy=apf", *RUN), timeout=120)
    assert proc.returncode != 0
    refusal = [line for line in proc.stderr.splitlines() if "strategy=apf" in line]
    assert len(refusal) == 1 and "privacy=central" in refusal[0], proc.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()
