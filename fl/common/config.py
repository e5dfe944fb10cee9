"""The run configuration: composed by Hydra, shipped to apps, and the rules checks use.

Every process of a run (the ServerApp, each ClientApp, on any engine) reads the same
resolved configuration from Flower's `run_config`: either the whole config as JSON
under `fl-config` (what `fl-run` sends), or Hydra overrides under `overrides`
(what `flwr run -c "overrides='strategy=fedprox rounds=5'"` sends), composed here
from the `conf/` tree. Each config group is checked by a function beside its subsystem,
written in the rules below (`require`, `check_int`, ...); `fl.run.validation` runs them.
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Union, cast, get_args, get_origin

from omegaconf import DictConfig, OmegaConf

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "check_choice",
    "check_int",
    "check_number",
    "compose",
    "from_run_config",
    "has_type",
    "is_finite",
    "plain",
    "require",
    "run_config_key",
    "run_faults",
    "to_run_config",
    "type_name",
]

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
RUN_CONFIG_KEY = "fl-config"


class ConfigError(ValueError):
    """An invalid configuration key or value, named in the message."""


def plain(node: Any) -> dict[str, Any]:
    """A config node as a plain dict with interpolations resolved."""
    if not isinstance(node, DictConfig):
        return dict(node)
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))


_FAULTS: dict[str, dict[str, Any]] = {}  # run config -> its faults group, as a plain dict


def run_faults(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's `faults` group (rates and attacks) as a plain dict, read once per process:
    the fault and attack mods consult it on every message, and reading an OmegaConf node
    costs more than the rest of either mod."""
    key = run_config_key(run_config)
    if key not in _FAULTS:
        _FAULTS[key] = plain(from_run_config(run_config).get("faults") or {})
    return _FAULTS[key]


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config of `conf/config.yaml` with Hydra command-line style overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides or [])


def to_run_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, str]:
    """Flower run_config carrying the resolved config (Hydra's own keys dropped)."""
    values = plain(cfg)
    values.pop("hydra", None)
    return {RUN_CONFIG_KEY: json.dumps(values, sort_keys=True)}


@lru_cache(maxsize=8)
def _parse(text: str) -> DictConfig:
    return OmegaConf.create(json.loads(text))


@lru_cache(maxsize=8)
def _compose_cached(overrides: str) -> DictConfig:
    cfg = compose(overrides.split())
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=False))
    values.pop("hydra", None)
    return OmegaConf.create(values)


def run_config_key(run_config: Mapping[str, Any]) -> str:
    """A string that identifies a run's config (for per-process caches)."""
    if RUN_CONFIG_KEY in run_config:
        return RUN_CONFIG_KEY + ":" + str(run_config[RUN_CONFIG_KEY])
    return "overrides:" + str(run_config.get("overrides", ""))


def from_run_config(run_config: Mapping[str, Any]) -> DictConfig:
    """The run's config, from either form of run_config (cached per process)."""
    if RUN_CONFIG_KEY in run_config:
        return _parse(str(run_config[RUN_CONFIG_KEY]))
    return _compose_cached(str(run_config.get("overrides", "")))


# ----- the rules every config group's check is written in -------------------------------
# Each subsystem checks its own group with these (`check_<group>` beside the subsystem,
# registered in pyproject's `fl.config_checks` entry points); `fl.run.validation` runs them.


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    """Raise ConfigError naming `key`, its `value` and the `rule` it breaks, unless `ok`."""
    if not ok:
        raise ConfigError(f"invalid config: {key}={value!r}: {rule}")


def check_int(cfg: DictConfig, key: str, low: int, high: int | None = None) -> None:
    """`key` must be an integer (not a bool) in [low, high]."""
    value = OmegaConf.select(cfg, key)
    top = math.inf if high is None else high
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= top
    rule = f">= {low}" if high is None else f"in [{low}, {high}]"
    require(ok, key, value, f"must be an integer {rule}")


def check_choice(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    """`key` must be one of `choices`."""
    value = OmegaConf.select(cfg, key)
    require(value in choices, key, value, f"must be one of {list(choices)}")


def is_finite(value: Any) -> bool:
    """A real int or float, not a bool, neither inf nor nan."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_number(
    cfg: DictConfig,
    key: str,
    low: float,
    high: float = math.inf,
    *,
    strict: bool = False,
    null: bool = False,
) -> None:
    """`key` must be a finite number in [low, high] (above `low` if strict), or null if allowed."""
    value = OmegaConf.select(cfg, key)
    if null and value is None:
        return
    ok = is_finite(value) and (value > low if strict else value >= low) and value <= high
    bound = f"> {low}" if strict else f">= {low}"
    rule = bound if high == math.inf else f"in {'(' if strict else '['}{low}, {high}]"
    require(ok, key, value, f"must be {'null or ' if null else ''}a finite number {rule}")


def has_type(value: Any, hint: Any) -> bool:
    """Whether a config value fits a params field's annotation (floats finite, no bool as int)."""
    if isinstance(hint, types.UnionType) or get_origin(hint) is Union:
        return any(has_type(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return is_finite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    return True  # richer annotations are left to the params' own `validate`


def type_name(hint: Any) -> str:
    """A params field's annotation as a message says it ("a finite number")."""
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    if isinstance(hint, types.UnionType) or get_origin(hint) is Union:
        return " or ".join(type_name(arg) for arg in get_args(hint))
    return names.get(hint, "null" if hint is type(None) else str(hint))
