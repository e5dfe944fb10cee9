"""Hydra search-path plugin: config groups shipped inside strategy plugin packages.

A package that adds a strategy through the `fl.strategies` entry-point group may ship its
Hydra config beside the module the entry point names, in `conf/` (for example
`my_pkg/conf/strategy/my_algo.yaml` next to `my_pkg/my_algo.py`). Hydra imports every
module under the `hydra_plugins` namespace package and asks each SearchPathPlugin for
config roots; this one appends those `conf/` folders after the project's own `conf/`,
so `fl-run strategy=my_algo` finds the plugin's file with no extra step, and the
project's own files win a name clash.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import entry_points
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

__all__ = ["StrategyConfigSearchPath", "plugin_conf_dirs"]

# fl.strategy.registry.ENTRY_POINT_GROUP, not imported: keep Hydra's scan light
GROUP = "fl.strategies"
PROJECT_CONF = Path(__file__).resolve().parents[2] / "conf"


def plugin_conf_dirs() -> list[Path]:
    """The `conf/` folder beside each `fl.strategies` entry point's module, where one exists."""
    found: list[Path] = []
    for entry in entry_points(group=GROUP):
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


class StrategyConfigSearchPath(SearchPathPlugin):
    """Adds every strategy plugin's `conf/` to Hydra's config search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for conf in plugin_conf_dirs():
            search_path.append(provider="fl-strategy-plugin", path=f"file://{conf}")
