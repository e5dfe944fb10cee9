"""Which registered strategy a params class belongs to, so a server half can name itself.

`register` records each strategy's params class here; a server half looks its own params
up when it is built, so every train instruction it makes carries its strategy's name and
contract version (`fl.wire.contract.stamp`), whoever drives it: our round loop or Flower's
own `Strategy.start`. Kept apart from the registry so that the server half need not
import it (the registry checks server classes, so it imports the server half).
"""

from __future__ import annotations

__all__ = ["name_params", "strategy_of"]

_NAMES: dict[type, str | None] = {}  # params class -> strategy name (None: ambiguous)


def name_params(params: type, name: str) -> None:
    """Record that `params` is strategy `name`'s params class."""
    known = _NAMES.get(params, name)
    _NAMES[params] = name if known == name else None  # one class, two names: no guess


def strategy_of(params: object) -> str | None:
    """The strategy whose params `params` are, if exactly one registered them."""
    return _NAMES.get(type(params))
