"""The layout's contracts: floors that import downwards, old paths that still resolve, a
strategy surface that keeps algorithms off the kernel's plumbing, checks by config group."""

import ast
import importlib
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

import fl.run.validation as validation
from fl.common import moved
from fl.common.config import ConfigError, compose, require
from fl.mechanisms.diagnosis import LinearityTest, PerturbationEMA
from fl.run.apps import CLIENT_APP, SERVER_APP, Apps
from fl.run.checkpoint import load_checkpoint, save_checkpoint
from fl.strategy.registry import available, get_strategy
from fl.strategy.server import ALGORITHM_HOOKS, KERNEL_METHODS, ServerStrategy

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fl", "server", "clients", "privacy", "strategies")
LONG = 530  # lines: a module longer than this says at its top why it is one module
REASON = "Why one module:"


def test_the_import_contracts_hold():
    """`make lint`'s contracts, here too so that CI holds them (it runs `make test`)."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("fl.hooks", "fl.strategy.client"),
        ("fl.registry", "fl.strategy.registry"),
        ("fl.codec", "fl.wire.codec"),
        ("fl.codec.core", "fl.wire.codec.core"),
        ("fl.clock", "fl.world.clock"),
        ("fl.transport.grid", "fl.net.transport.grid"),
        ("fl.engines.local", "fl.run.engines.local"),
    ],
)
def test_an_old_import_path_is_the_module_at_its_new_path(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_every_moved_path_names_a_module_that_exists():
    for old, new in moved.MOVED.items():
        assert importlib.util.find_spec(new) is not None, (old, new)
    assert moved.new_path("fl.codec.encodings") == "fl.wire.codec.encodings"
    assert moved.new_path("fl.wire.records") is None  # not moved: the real module answers
    assert moved.new_path("fl.transportation") is None  # a prefix of a name is not a package


def test_the_old_package_names_keep_their_public_names():
    from fl.run import latest_run, main
    from fl.strategy import ClientUpdate
    from fl.strategy import ServerStrategy as Base

    assert Base is ServerStrategy and ClientUpdate.__module__ == "fl.strategy.updates"
    assert callable(main) and callable(latest_run)


def test_a_checkpoint_naming_a_state_class_by_its_old_path_loads(tmp_path, monkeypatch):
    state = PerturbationEMA.zeros(4, 0.5)
    state.signed += 1.5
    monkeypatch.setattr(PerturbationEMA, "__module__", "fl.diagnosis")  # as pickled before
    importlib.import_module("fl.diagnosis")  # the old path resolves, so pickle finds the class
    path = tmp_path / "old.pt"
    save_checkpoint(path, {"strategy": {"ema": state}})
    monkeypatch.undo()
    assert b"fl.diagnosis" in path.read_bytes() and b"fl.mechanisms" not in path.read_bytes()
    loaded = load_checkpoint(path, required=("strategy",))["strategy"]["ema"]
    assert isinstance(loaded, PerturbationEMA) and torch.equal(loaded.signed, state.signed)
    # LinearityTest moved from fl.speculation, not from its module's old path
    assert moved.old_names([LinearityTest]) == [(LinearityTest, "fl.speculation.LinearityTest")]


def test_a_strategy_that_overrides_kernel_plumbing_is_refused():
    with pytest.raises(TypeError, match=r"overrides check_reply.*override check_update instead"):

        class Sneaky(ServerStrategy):
            def check_reply(self, reply):  # type: ignore[misc]
                return super().check_reply(reply)


def test_the_two_surfaces_are_apart_and_every_strategy_keeps_to_its_own():
    assert not set(ALGORITHM_HOOKS) & set(KERNEL_METHODS)
    for name in (*ALGORITHM_HOOKS, *KERNEL_METHODS):
        assert callable(getattr(ServerStrategy, name)), name
    for name in available():
        server = get_strategy(name).server
        for method in KERNEL_METHODS:
            assert getattr(server, method) is getattr(ServerStrategy, method), (name, method)


def test_fl_run_loads_the_apps_flwr_run_names():
    components = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert components["components"] == {"serverapp": SERVER_APP, "clientapp": CLIENT_APP}
    apps = Apps.load()
    assert (apps.server_ref, apps.client_ref) == (SERVER_APP, CLIENT_APP)
    with pytest.raises(TypeError, match="must name a ServerApp and a ClientApp"):
        Apps.load(SERVER_APP, SERVER_APP)


def test_every_config_group_check_is_registered_and_runs_in_order():
    names = [name for name, _ in validation.checks()]
    assert names[: len(validation.ORDER)] == list(validation.ORDER)


def _plugin_check(cfg: DictConfig) -> None:
    require(cfg.rounds < 3, "rounds", cfg.rounds, "this plugin allows at most 2")


def test_a_plugins_config_check_runs_after_ours(monkeypatch):
    ours = list(validation.entry_points(group=validation.ENTRY_POINT_GROUP))
    plugin = EntryPoint("zz_plugin", f"{__name__}:_plugin_check", validation.ENTRY_POINT_GROUP)
    monkeypatch.setattr(validation, "entry_points", lambda group: [*ours, plugin])
    validation.checks.cache_clear()
    try:
        validation.validate(compose(["rounds=2"]))
        with pytest.raises(ConfigError, match="rounds=5: this plugin allows at most 2"):
            validation.validate(compose(["rounds=5"]))
        with pytest.raises(ConfigError, match="num_clients"):  # ours first
            validation.validate(compose(["rounds=5", "num_clients=0"]))
    finally:
        validation.checks.cache_clear()


def _modules():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_every_module_opens_with_a_docstring_and_long_ones_say_why():
    for path in _modules():
        source = path.read_text()
        doc = ast.get_docstring(ast.parse(source))
        assert doc or (path.name == "__init__.py" and not source.strip()), path
        if source.count("\n") > LONG:
            assert doc is not None and REASON in doc, f"{path}: over {LONG} lines, no reason"


def test_each_floor_of_fl_says_what_lives_there():
    floors = [p for p in (ROOT / "fl").iterdir() if (p / "__init__.py").is_file()]
    assert {p.name for p in floors} == {
        "common",
        "wire",
        "world",
        "mechanisms",
        "strategy",
        "net",
        "run",
    }
    for floor in floors:
        doc = ast.get_docstring(ast.parse((floor / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 25, floor
