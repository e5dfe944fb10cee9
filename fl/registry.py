"""Strategies by name: a server half, a client half and a dataclass of hyper-parameters.

Strategies are found through the `fl.strategies` entry-point group, so a third-party
package adds one by declaring an entry point; `server/` and `clients/` never import a
concrete strategy module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fl.hooks import ClientHooks
    from fl.strategy import ServerStrategy

__all__ = ["ENTRY_POINT_GROUP", "StrategySpec", "available", "get_strategy", "register"]

ENTRY_POINT_GROUP = "fl.strategies"
_REGISTRY: dict[str, StrategySpec] = {}


@dataclass(frozen=True)
class StrategySpec:
    """Everything an algorithm is, as the runtime needs it."""

    name: str
    server: type[ServerStrategy]
    client: type[ClientHooks]
    params: type

    def make_params(self, values: Mapping[str, Any]) -> Any:
        """The params dataclass from config values; unknown keys and bad types fail by name."""
        fields = {f.name: f for f in dataclasses.fields(self.params)}
        unknown = sorted(set(values) - set(fields) - {"name"})
        if unknown:
            raise ValueError(
                f"strategy {self.name!r} has no parameter {unknown[0]!r}; known: {sorted(fields)}"
            )
        kwargs = {k: v for k, v in values.items() if k in fields}
        params = self.params(**kwargs)
        check = getattr(params, "validate", None)
        if check is not None:
            check()
        return params


def register(name: str, *, server: type, client: type, params: type) -> StrategySpec:
    """Add a strategy under `name` and return its spec (modules assign it to `STRATEGY`)."""
    if not dataclasses.is_dataclass(params):
        raise TypeError(f"params of strategy {name!r} must be a dataclass")
    spec = StrategySpec(name, server, client, params)
    _REGISTRY[name] = spec
    return spec


def _discovered() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    """Names of every registered or installed strategy."""
    return sorted(set(_REGISTRY) | set(_discovered()))


def get_strategy(name: str) -> StrategySpec:
    """The spec registered under `name`, loading its entry point on first use."""
    if name not in _REGISTRY:
        entry = _discovered().get(name)
        if entry is None:
            raise ValueError(f"unknown strategy {name!r}; available: {available()}")
        spec = entry.load()
        _REGISTRY.setdefault(name, spec)
    return _REGISTRY[name]
