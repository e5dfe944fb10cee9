"""A run folder dropped into outputs/ is data: it cannot choose which files `fl-run
resume=latest` composes, so a yaml planted beside it never installs a Hydra callback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from conftest import fl_run_cmd, python_run, run_fl

from fl.common.config import CONF_DIR, ConfigError
from fl.run.cli import _group_options
from fl.run.settings import run_overrides

SOURCE = "outputs/x/.hydra/overrides.yaml"


@pytest.mark.parametrize(
    "override",
    [
        "experiment=../../outputs/run/evil",
        "+experiment=../evil",
        "strategy=/tmp/evil",
        "strategy=fedavg/../../evil",
        "system/../../outputs=evil",
        "strategy@_global_=../evil",
        "experiment=no_such_preset",
        "experiment=[a,b]",
        "engine=local,evil",
    ],
)
def test_a_saved_group_choice_must_be_an_option_of_conf(override):
    with pytest.raises(ConfigError) as err:
        run_overrides([override], SOURCE, _group_options)
    assert SOURCE in str(err.value) and repr(override) in str(err.value)


def test_saved_options_values_and_null_are_replayed():
    saved = [
        "strategy=apf",
        "engine=flower-sim",
        "experiment=null",
        "experiment/asfl_arm=fedavg",
        "strategy.threshold=0.3",
        "rounds=3",
    ]
    assert run_overrides(saved, SOURCE, _group_options) == saved


EVIL = """# @package _global_
hydra:
  callbacks:
    evil:
      _target_: builtins.open
      _args_: [{marker}, "w"]
"""


@pytest.mark.parametrize("group", ["experiment", "strategy"])
def test_resume_latest_never_composes_a_yaml_planted_in_the_run_folder(
    tmp_path, tiny_overrides, group
):
    run = tmp_path / "outputs" / "run"
    run_fl(run, *tiny_overrides, "rounds=1", "checkpoint_every=1")
    marker = tmp_path / "code-ran"
    (run / "evil.yaml").write_text(EVIL.format(marker=str(marker)))
    # the path from conf/GROUP/ to the planted file, as Hydra would resolve a group option
    planted = os.path.relpath(run / "evil", CONF_DIR / group)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"{group}={planted}"]))
    before = (run / "checkpoint.pt").read_bytes()
    proc = python_run(fl_run_cmd("resume=latest", "rounds=2"), cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("fl-run: resume=latest:") and f"{group}={planted}" in line, line
    assert "not one of the options" in line
    assert not marker.exists()
    assert (run / "checkpoint.pt").read_bytes() == before
    assert not Path(tmp_path / "multirun").exists()
