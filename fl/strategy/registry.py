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
    from fl.strategy.client import ClientHooks
    from fl.strategy.server import ServerStrategy
from typing import get_type_hints

from omegaconf import DictConfig

from fl.common.config import ConfigError, has_type, plain, require, type_name
from fl.strategy.names import name_params

__all__ = [
    "ENTRY_POINT_GROUP",
    "StrategySpec",
    "available",
    "check_strategy",
    "get_strategy",
    "register",
]

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
    """Add a strategy under `name` and return its spec (modules assign it to `STRATEGY`).

    The halves are checked here, not at the first kernel call of a run: a server half
    must subclass `ServerStrategy` (Flower's own classes run through `strategy=flower`),
    a client half `ClientHooks`, and params must be a dataclass."""
    # imported here, not above: the registry stays light (no torch) for config checks, and
    # a strategy module that calls register() has imported both halves' bases already
    from fl.strategy.client import ClientHooks
    from fl.strategy.server import ServerStrategy

    if not isinstance(server, type) or not issubclass(server, ServerStrategy):
        raise TypeError(_not_a_server(name, server))
    if not isinstance(client, type) or not issubclass(client, ClientHooks):
        raise TypeError(
            f"strategy {name!r}: client={_qualname(client)} is not a subclass of "
            "fl.strategy.client.ClientHooks (the client half: override only the hooks "
            "that differ from FedAvg's; docs/STRATEGIES.md)"
        )
    if not isinstance(params, type) or not dataclasses.is_dataclass(params):
        raise TypeError(f"strategy {name!r}: params={_qualname(params)} must be a dataclass")
    spec = StrategySpec(name, server, client, params)
    _REGISTRY[name] = spec
    name_params(params, name)
    return spec


def _qualname(thing: object) -> str:
    return getattr(thing, "__qualname__", repr(thing))


def _not_a_server(name: str, server: object) -> str:
    """Why `server` cannot be a server half, pointing a Flower class to the adapter."""
    from flwr.serverapp.strategy import Strategy

    what = f"strategy {name!r}: server={_qualname(server)} is not a subclass of "
    what += "fl.strategy.server.ServerStrategy"
    if isinstance(server, type) and issubclass(server, Strategy):
        return (
            f"{what}; it is a Flower strategy: run it through our adapter with "
            f"`fl-run strategy=flower strategy.flower_class={server.__name__}` "
            "(its arguments as +strategy.kwargs.NAME=VALUE), or subclass ServerStrategy"
        )
    return f"{what} (a server half: override only the hooks that differ; docs/STRATEGIES.md)"


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
        try:
            spec = entry.load()
        except Exception as err:  # a plugin's import error, or a class register() refused
            raise ValueError(
                f"strategy {name!r}: its entry point {entry.value} does not load: "
                f"{type(err).__name__}: {err}"
            ) from err
        if not isinstance(spec, StrategySpec):
            raise ValueError(
                f"strategy {name!r}: its entry point {entry.value} is a "
                f"{type(spec).__name__}, not the StrategySpec that register() returns"
            )
        _REGISTRY.setdefault(name, spec)
    return _REGISTRY[name]


def check_strategy(cfg: DictConfig) -> None:
    """Each `strategy.KEY` must have its params field's type, then pass the params' `validate`
    and, where the params have one, `validate_run` against the run's other keys."""
    values = plain(cfg.strategy)
    try:
        spec = get_strategy(str(values.get("name")))
    except ValueError as err:
        raise ConfigError(f"invalid config: strategy.name: {err}") from err
    hints = get_type_hints(spec.params)
    for key, value in values.items():
        if key in hints:
            hint = hints[key]
            require(has_type(value, hint), f"strategy.{key}", value, f"must be {type_name(hint)}")
    try:
        params = spec.make_params(values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid config: strategy: {err}") from err
    every = cfg.get("evaluate_every", 1)
    require(
        every == 1 or not getattr(spec.server, "reads_round_accuracy", False),
        "evaluate_every",
        every,
        f"strategy={values.get('name')} reads the global model's accuracy every round (its "
        "controller's input): use 1",
    )
    check_run = getattr(params, "validate_run", None)  # the params against the run's keys
    if check_run is not None:
        try:
            check_run(cfg)
        except ValueError as err:
            raise ConfigError(f"invalid config: {err}") from err
