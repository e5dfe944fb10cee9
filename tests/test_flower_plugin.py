"""A strategy plugin package ships its Hydra config; `fl-run strategy=NAME` finds it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, fl_env, fl_run_cmd, python_run, read_metrics
from netns import in_netns, require_netns
from omegaconf import OmegaConf

PLUGIN = REPO / "examples" / "strategy_plugin"
RUN = ["strategy=fedavg_slr", "num_clients=4", "clients_per_round=4", "rounds=2"]
RUN += ["local_epochs=1", "progress=false"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plugin pip-installed from disk, offline, into a folder of its own."""
    root = tmp_path_factory.mktemp("plugin")
    source = shutil.copytree(PLUGIN, root / "src")  # builds leave build/ beside the source
    target = root / "site"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index"]
    command += ["--no-build-isolation", "--no-deps", "--target", str(target), str(source)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=fl_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _env(site: Path) -> dict[str, str]:
    return {**fl_env(), "PYTHONPATH": str(site)}


def test_plugin_config_and_strategy_are_found_on_the_local_engine(site, tmp_path):
    # From a directory outside the repository, in a fresh interpreter that sees the plugin
    run_dir = tmp_path / "run"
    cmd = fl_run_cmd(f"hydra.run.dir={run_dir}", *RUN)
    proc = python_run(cmd, cwd=tmp_path, env=_env(site), fresh=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    config = OmegaConf.load(run_dir / "config.yaml")
    assert config.strategy == {"name": "fedavg_slr", "server_lr": 0.5}  # the plugin's yaml
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2] and rows[-1]["accuracy"] > 0.2


def test_plugin_strategy_steps_by_its_server_lr(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    from fl_example_plugin.fedavg_slr import SLRParams, SLRServer

    from fl.strategy.server import ClientUpdate

    server = SLRServer(SLRParams(server_lr=0.25), seed=0, clients_per_round=2)
    server.global_vector = torch.zeros(3)
    updates = [ClientUpdate(n, torch.full((3,), float(n)), 1, {}) for n in (2, 6)]
    assert torch.equal(server.aggregate(1, updates), torch.full((3,), 1.0))  # 0.25 x mean 4


def test_without_the_plugin_the_name_is_unknown(tmp_path):
    proc = python_run(fl_run_cmd(f"hydra.run.dir={tmp_path}", *RUN), cwd=tmp_path, fresh=True)
    assert proc.returncode != 0
    assert "fedavg_slr" in proc.stderr and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow  # Ray start-up
@pytest.mark.integration
def test_plugin_on_flowers_simulation(site, tmp_path):
    require_netns()
    cmd = fl_run_cmd(f"hydra.run.dir={tmp_path}", *RUN, "engine=flower-sim")
    proc = subprocess.run(
        in_netns(cmd), cwd=tmp_path, env=_env(site), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["round"] for r in read_metrics(tmp_path)] == [1, 2]
