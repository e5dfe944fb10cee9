"""The public API (fl/api.py) is what docs/API.md lists, it resolves, and the changes it
promised to keep working do: run_local without apps, APFServer.trained_mask."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import REPO, read_metrics
from flwr.app import ArrayRecord, ConfigRecord

import fl.api
from fl.run.apps import load_app

DOC = (REPO / "docs" / "API.md").read_text()


def test_docs_api_lists_exactly_the_public_names():
    listed = set(re.findall(r"^\| `fl\.api\.(\w+)` \|", DOC, flags=re.MULTILINE))
    assert listed == set(fl.api.__all__)
    references = set(re.findall(r"^\| `(\w+(?:\.\w+)*:\w+)` \|", DOC, flags=re.MULTILINE))
    assert references == set(fl.api.APPS)


def test_every_public_name_resolves():
    assert all(getattr(fl.api, name, None) is not None for name in fl.api.__all__)
    assert all(callable(load_app(reference)) for reference in fl.api.APPS)


def test_readme_and_strategies_point_to_the_api_page():
    assert "(docs/API.md)" in (REPO / "README.md").read_text()
    assert "(API.md)" in (REPO / "docs" / "STRATEGIES.md").read_text()


def test_run_local_without_apps_runs_ours(tmp_path):
    # its signature before `apps` was added (issue 38: scripts broke with a TypeError)
    overrides = ["num_clients=2", "clients_per_round=2", "rounds=1", "local_steps=2"]
    cfg = fl.api.compose([*overrides, f"output_dir={tmp_path}", "progress=false"])
    fl.api.validate(cfg)
    fl.api.run_local(cfg, fl.api.to_run_config(cfg))
    rows = read_metrics(tmp_path)
    assert [r["round"] for r in rows] == [1] and rows[0]["replies"] == 2


def test_apf_trained_mask_is_a_deprecated_alias_of_the_round_sent():
    spec = fl.api.get_strategy("apf")
    server = spec.server(spec.make_params({"threshold": 0.5}), seed=0, clients_per_round=1)
    with pytest.warns(DeprecationWarning, match="APFServer.trained_mask is deprecated"):
        assert server.trained_mask.numel() == 0  # before the first round
    arrays = ArrayRecord({"w": torch.ones(8)})
    grid = fl.api.LocalGrid(load_app("clients.app:app"), 1, {})
    list(server.configure_train(1, arrays, ConfigRecord(), grid))
    server.freezing.active[:3] = False  # as a stability check does after aggregation
    with pytest.warns(DeprecationWarning, match="strategy.freezing.active"):
        mask = server.trained_mask
    assert mask.dtype == torch.bool and bool(mask.all()) and mask.numel() == 8
