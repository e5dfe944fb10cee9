"""engine=deployment: how `fl-run` submits, and how it reports runs that fail on a SuperLink.

The run that completes (and matches `engine=local` bit for bit) is the one-machine trial
of docs/DEPLOYMENT.md, run verbatim by tests/test_flwr_run.py.
"""

from __future__ import annotations

import io
import os
import shutil
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from federation import running_federation, submit
from flwr.cli.build import build_fab_from_disk
from omegaconf import OmegaConf

from fl.common.config import CONF_DIR
from fl.run.engines.deployment import (
    CONNECTION,
    REPO,
    app_files,
    flower_connection,
    flower_home,
    server_overrides,
    staged_app,
)
from server.nodes import NODE_WAIT_S


@pytest.mark.integration
def test_too_few_supernodes_fail_the_run_after_the_node_wait(tmp_path):
    # Two SuperNodes, three clients asked for: the ServerApp waits engine.node_wait_s,
    # then fails the run (before it loads data or writes outputs), Flower marks it
    # finished:failed, `flwr run --stream` still exits 0, and fl-run must exit non-zero
    # with Flower's details, which name both fixes.
    overrides = ["num_clients=3", "clients_per_round=3", "rounds=1", "engine.node_wait_s=3"]
    with running_federation(tmp_path / "federation") as fed:
        start = time.monotonic()
        proc = submit(fed, tmp_path / "run", *overrides, timeout=120)
        elapsed = time.monotonic() - start
        assert proc.returncode != 0, proc.stdout[-3000:] + fed.logs()
    assert "ended as finished:failed" in proc.stderr
    assert "only 2 of 3 nodes connected after 3 s" in proc.stderr
    assert "start 3 SuperNodes" in proc.stderr and "set num_clients=2" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert elapsed < 90, elapsed


def test_the_node_wait_default_is_the_same_in_the_config_and_the_server():
    assert OmegaConf.load(CONF_DIR / "engine" / "deployment.yaml").node_wait_s == NODE_WAIT_S


# ----- the submission itself, without a SuperLink -------------------------------------------


def test_the_staged_app_packs_the_fab_flwr_packs_from_the_checkout(tmp_path):
    """`flwr run` of the staged copy submits the same FAB bytes as of the checkout, whose
    ignored folders (a virtualenv, run outputs), ignored files and symlinks stay out."""
    app = tmp_path / "app"
    kept = [
        "pyproject.toml",
        ".gitignore",
        "fl/__init__.py",
        "clients/__init__.py",
        "server/app.py",
        "strategies/__init__.py",
        "privacy/__init__.py",
        "conf/config.yaml",
        "hydra_plugins/adaptive_fl/__init__.py",
    ]  # a file in each folder the pyproject's `fab-include` names (flwr refuses a pattern
    # that matches nothing)
    for name in kept:
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, app / name)
    extra = {
        ".venv/lib/site.py": "ignored folder",
        "experiments/out/run/metrics.jsonl": "{}",  # /experiments/out/
        "experiments/notes.md": "kept",
        "fl/__pycache__/x.py": "ignored folder at depth",
        "fl/module.pyc": "ignored file",
        "outputs/a.yaml": "a: 1",
    }
    for name, text in extra.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(text)
    os.symlink(REPO / "README.md", app / "linked.md")
    assert app_files(app) == sorted([*kept, "experiments/notes.md"])
    with staged_app(app) as staged:
        assert build_fab_from_disk(staged) == build_fab_from_disk(app)


def test_the_fab_carries_what_the_apps_run_and_leaves_records_docs_and_tests_behind():
    """Each ClientApp process re-hashes the whole FAB (one per message in flwr 1.42): the
    pyproject's `fab-include` keeps out what no app imports, and nothing the apps need."""
    with staged_app() as staged:
        names = set(zipfile.ZipFile(io.BytesIO(build_fab_from_disk(staged))).namelist())
    tops = {name.split("/")[0] for name in names}
    assert not tops & {"experiments", "docs", "tests", "examples"}
    packages = ("fl", "clients", "server", "strategies", "privacy", "conf", "hydra_plugins")
    needed = {
        name
        for name in app_files(REPO)
        if name.startswith(tuple(f"{p}/" for p in packages)) and name.endswith((".py", ".yaml"))
    }
    assert len(needed) > 250 and needed <= names
    assert "pyproject.toml" in names


def test_server_overrides_pin_an_absolute_output_dir():
    user = ["strategy=fedprox", "rounds=5", "output_dir=/elsewhere", "+extra.key=1"]
    assert (
        server_overrides(user, "/srv/out")
        == "strategy=fedprox rounds=5 +extra.key=1 output_dir=/srv/out"
    )
    with pytest.raises(SystemExit, match="absolute"):
        server_overrides(["rounds=5"], "outputs/x")
    with pytest.raises(SystemExit, match="whitespace"):
        server_overrides(["task.hidden=[64, 64]"], "/srv/out")


def test_flower_connection_follows_engine_tls_settings(tmp_path):
    engine = {"superlink": "10.0.0.5:8000", "insecure": True, "root_certificates": None}
    assert flower_connection(OmegaConf.create({"engine": engine})) == {
        "address": "10.0.0.5:8000",
        "insecure": True,
    }
    tls = {**engine, "insecure": False, "root_certificates": str(tmp_path / "ca.pem")}
    assert flower_connection(OmegaConf.create({"engine": tls})) == {
        "address": "10.0.0.5:8000",
        "root-certificates": str(tmp_path / "ca.pem"),
    }


def test_a_user_flwr_home_keeps_its_connections(tmp_path, monkeypatch):
    (tmp_path / "config.toml").write_text(
        '[superlink]\ndefault = "mine"\n[superlink.mine]\naddress = "1.2.3.4:8000"\n'
    )
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    engine = {"superlink": "127.0.0.1:8000", "insecure": True, "root_certificates": None}
    with flower_home(OmegaConf.create({"engine": engine})) as home:
        assert home == tmp_path
    config = tomllib.loads((tmp_path / "config.toml").read_text())
    assert config["superlink"]["default"] == "mine"
    assert config["superlink"]["mine"] == {"address": "1.2.3.4:8000"}
    assert config["superlink"][CONNECTION] == {"address": "127.0.0.1:8000", "insecure": True}


def test_without_flwr_home_a_private_one_is_used_and_removed(monkeypatch):
    monkeypatch.delenv("FLWR_HOME", raising=False)
    engine = {"superlink": "127.0.0.1:8000", "insecure": True, "root_certificates": None}
    with flower_home(OmegaConf.create({"engine": engine})) as home:
        assert home != Path.home() / ".flwr"
        assert tomllib.loads((home / "config.toml").read_text())["superlink"][CONNECTION]
    assert not home.exists()
