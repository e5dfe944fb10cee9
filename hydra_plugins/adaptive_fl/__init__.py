"""Hydra search-path plugin: config groups shipped inside strategy plugin packages.

A package that adds a strategy through the `fl.strategies` entry-point group may ship its
Hydra config beside the module the entry point names, in `conf/` (for example
`my_pkg/conf/strategy/my_algo.yaml` next to `my_pkg/my_algo.py`). Hydra imports every
module under the `hydra_plugins` namespace package and asks each SearchPathPlugin for
config roots; this one appends those `conf/` folders after the project's own `conf/`,
so `fl-run strategy=my_algo` finds the plugin's file with no extra step, and the
project's own files win a name clash.

An installed strategy with no `strategy/NAME.yaml` anywhere (a package that left its
package data out) is not refused as "no such option": its params dataclass's defaults
become the config group's option (Hydra's ConfigStore, after every folder), with one
warning naming the file that is missing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import MISSING, OmegaConf

__all__ = [
    "StrategyConfigSearchPath",
    "default_strategy_config",
    "plugin_conf_dirs",
    "strategy_names",
    "without_config",
]

log = logging.getLogger(__name__)

# fl.strategy.registry.ENTRY_POINT_GROUP, not imported: keep Hydra's scan light
GROUP = "fl.strategies"
PROJECT_CONF = Path(__file__).resolve().parents[2] / "conf"


def _installed() -> tuple[EntryPoint, ...]:
    """The `fl.strategies` entry points on the current import path."""
    return _installed_on(tuple(sys.path))


@functools.lru_cache(maxsize=8)
def _installed_on(path: tuple[str, ...]) -> tuple[EntryPoint, ...]:
    """Scanned once per import path: reading every distribution's metadata costs ~15 ms, and
    a run asks for these on each of its (three) compositions and its choice checks."""
    return tuple(entry_points(group=GROUP))


def plugin_conf_dirs() -> list[Path]:
    """The `conf/` folder beside each `fl.strategies` entry point's module, where one exists."""
    found: list[Path] = []
    for entry in _installed():
        try:
            spec = importlib.util.find_spec(entry.module)
        except (ImportError, ValueError):
            continue  # a broken plugin is reported by name when its strategy is asked for
        if spec is None or spec.origin is None:
            continue
        conf = Path(spec.origin).resolve().parent / "conf"
        if conf.is_dir() and conf != PROJECT_CONF and conf not in found:
            found.append(conf)
    return found


def strategy_names() -> list[str]:
    """Names of the installed strategies (entry points), none of them imported."""
    return sorted({entry.name for entry in _installed()})


def without_config() -> list[EntryPoint]:
    """Installed strategies with no `strategy/NAME.yaml` in our conf/ or any plugin's."""
    roots = [PROJECT_CONF, *plugin_conf_dirs()]
    return [
        entry
        for entry in _installed()
        if not any((root / "strategy" / f"{entry.name}.yaml").is_file() for root in roots)
    ]


def default_strategy_config(entry: EntryPoint) -> dict[str, Any]:
    """`name` and the params dataclass's defaults (a field without one is required: ???).
    Only `name` where the entry point does not load: the run's validation says why."""
    config: dict[str, Any] = {"name": entry.name}
    try:
        params = entry.load().params
        for field in dataclasses.fields(params):
            if field.default is not dataclasses.MISSING:
                config[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                config[field.name] = field.default_factory()
            else:
                config[field.name] = MISSING
        OmegaConf.create(config)  # every default must be a config value
    except Exception:  # an import error, a class register() refused, an odd default
        return {"name": entry.name}
    return config


def _expected_yaml(entry: EntryPoint) -> str:
    """Where the plugin's config file belongs: conf/strategy/NAME.yaml beside its module."""
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return f"conf/strategy/{entry.name}.yaml beside module {entry.module}"
    return str(Path(spec.origin).resolve().parent / "conf" / "strategy" / f"{entry.name}.yaml")


@functools.cache
def _store_defaults(names: tuple[str, ...]) -> None:
    """Each config-less strategy's defaults as option `strategy/NAME` (once per process)."""
    store = ConfigStore.instance()
    for entry in without_config():
        if entry.name in names:
            log.warning(
                "strategy %s: no %s (package data left out?): using its params' defaults",
                entry.name,
                _expected_yaml(entry),
            )
            store.store(group="strategy", name=entry.name, node=default_strategy_config(entry))


class StrategyConfigSearchPath(SearchPathPlugin):
    """Adds every strategy plugin's `conf/` to Hydra's config search path, and a default
    config for an installed strategy that ships none."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for conf in plugin_conf_dirs():
            search_path.append(provider="fl-strategy-plugin", path=f"file://{conf}")
        _store_defaults(tuple(sorted(entry.name for entry in without_config())))
