"""An installed strategy plugin whose conf/strategy/NAME.yaml was left out of its package:
its params' defaults stand in, it is listed among the choices, and a broken one is named."""

from __future__ import annotations

import shutil
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from conftest import REPO, fl_env, fl_run_cmd, python_run, read_metrics
from omegaconf import OmegaConf

PLUGIN = REPO / "examples" / "strategy_plugin" / "fl_example_plugin"
RUN = ["num_clients=4", "clients_per_round=4", "rounds=2", "local_epochs=1"]


def _site(root: Path) -> Path:
    """The example plugin as pip would install it without its package data: the module and
    its entry point (a dist-info folder), no conf/."""
    site = root / "site"
    shutil.copytree(PLUGIN, site / PLUGIN.name, ignore=shutil.ignore_patterns("conf"))
    info = site / "fl_example_plugin-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fl-example-plugin\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[fl.strategies]\nfedavg_slr = fl_example_plugin.fedavg_slr:STRATEGY\n"
    )
    return site


@pytest.fixture
def site(tmp_path: Path) -> Path:
    return _site(tmp_path)


def _fl_run(site: Path, cwd: Path, *overrides: str):
    env = {**fl_env(), "PYTHONPATH": f"{REPO}:{site}"}
    return python_run(fl_run_cmd(*overrides), cwd=cwd, env=env, fresh=True)


def test_a_plugin_without_its_yaml_runs_on_its_params_defaults(site, tmp_path):
    assert not (site / PLUGIN.name / "conf").exists()
    run_dir = tmp_path / "run"
    # its keys are the dataclass's, so they override like any yaml's (no `+`)
    overrides = ["strategy=fedavg_slr", "strategy.server_lr=0.8", *RUN]
    proc = _fl_run(site, tmp_path, f"hydra.run.dir={run_dir}", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    missing = site / PLUGIN.name / "conf" / "strategy" / "fedavg_slr.yaml"
    assert f"strategy fedavg_slr: no {missing} (package data left out?)" in proc.stderr
    assert OmegaConf.load(run_dir / "config.yaml").strategy == {
        "name": "fedavg_slr",
        "server_lr": 0.8,
    }
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2]


def test_the_default_config_is_the_params_dataclass(site, monkeypatch):
    from hydra_plugins.adaptive_fl import default_strategy_config

    monkeypatch.syspath_prepend(str(site))
    value = "fl_example_plugin.fedavg_slr:STRATEGY"
    entry = EntryPoint(name="fedavg_slr", value=value, group="fl.strategies")
    assert default_strategy_config(entry) == {"name": "fedavg_slr", "server_lr": 1.0}
    broken = EntryPoint(name="nowhere", value="no_such_module:STRATEGY", group="fl.strategies")
    assert default_strategy_config(broken) == {"name": "nowhere"}  # validation says why


def test_an_installed_strategy_is_listed_among_the_choices(site, tmp_path):
    proc = _fl_run(site, tmp_path, f"hydra.run.dir={tmp_path}", "strategy=fedavg_slrr")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "fl-run: strategy=fedavg_slrr: no such option; did you mean strategy=fedavg_slr? "
    )
    assert "fedavg_slr," in last.partition("choices: ")[2] and "fedavg," in last


def test_a_plugin_that_does_not_import_is_named_in_one_line(site, tmp_path):
    module = site / PLUGIN.name / "fedavg_slr.py"
    module.write_text(module.read_text().replace("import torch\n", "import torch_nowhere\n", 1))
    proc = _fl_run(site, tmp_path, f"hydra.run.dir={tmp_path / 'run'}", "strategy=fedavg_slr")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "fl-run: invalid config: strategy.name: strategy 'fedavg_slr': its entry point "
        "fl_example_plugin.fedavg_slr:STRATEGY does not load: ModuleNotFoundError: "
        "No module named 'torch_nowhere'"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_strategy_of_ours_ships_its_yaml():
    # so that Hydra's plugin scan never imports a strategy module to build a default
    from hydra_plugins.adaptive_fl import without_config

    assert without_config() == []
