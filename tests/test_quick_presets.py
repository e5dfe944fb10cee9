"""A paper preset's quick variant, as a new user runs it: every arm prints its per-round
table, and the sweep lands under the current folder's multirun/, not inside experiments/."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import REPO, python_run
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fl.common.config import CONF_DIR

QUICK = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*_quick.yaml"))
TUNED = {n for n in QUICK if "tuning" in OmegaConf.load(CONF_DIR / "experiment" / f"{n}.yaml")}


@pytest.mark.parametrize("name", [n for n in QUICK if n not in TUNED])
def test_a_quick_variant_shows_progress_and_writes_under_multirun(name):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", [f"experiment={name}"], return_hydra_config=True)
    assert cfg.progress is True
    sweep_dir = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["dir"]
    assert sweep_dir.startswith("multirun/"), sweep_dir  # the default, or multirun/NAME/


def test_a_quick_sweep_prints_every_arms_rounds_in_the_folder_it_runs_from(tmp_path):
    cmd = [sys.executable, "-m", "fl.run", "experiment=fedsu_headroom_quick"]
    proc = python_run(cmd, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^\s+([123])\s+0\.\d{4}\s", proc.stdout, re.M)
    assert rows == ["1", "2", "3"] * 3  # three arms (fedavg, fedsu, apf), three rounds each
    [comparison] = tmp_path.glob("multirun/fedsu_headroom_quick/*/comparison.md")
    assert comparison.read_text().count("| strategy=") == 3
    assert not (tmp_path / "experiments").exists()
