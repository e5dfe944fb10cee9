"""Which classes may appear in checkpointed strategy state.

Checkpoints are loaded with torch's `weights_only` unpickler, which rebuilds tensors,
numbers, strings and containers, and objects only of classes on this list: a crafted
checkpoint cannot run code. A strategy whose `state_attributes` hold its own objects
marks their classes with `@checkpointable`.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["check_state_kind", "checkpointable", "state_types"]

T = TypeVar("T", bound=type)
_STATE_TYPES: list[type] = []


def checkpointable(cls: T) -> T:
    """Class decorator: instances may appear in checkpointed strategy state."""
    _STATE_TYPES.append(cls)
    return cls


def state_types() -> list[type]:
    """Every class marked `@checkpointable` so far (their modules are imported)."""
    return list(_STATE_TYPES)


def check_state_kind(name: str, fresh: Any, saved: Any) -> None:
    """`saved` may replace `fresh` (a strategy attribute as built): same container or
    tensor kind, a real number for a number. An attribute that starts None takes None, a
    number or a state class (`fl.common.checkpointable`), whose fields its strategy checks."""
    if fresh is None:
        number = isinstance(saved, int | float) and not isinstance(saved, bool)
        if saved is not None and not number and not isinstance(saved, tuple(state_types())):
            raise ValueError(f"strategy state: {name} is {type(saved).__name__}, not a state")
        return
    if isinstance(fresh, bool):
        ok = isinstance(saved, bool)
    elif isinstance(fresh, int | float):
        ok = isinstance(saved, int | float) and not isinstance(saved, bool)
    else:
        ok = isinstance(saved, type(fresh))
    if not ok:
        raise ValueError(
            f"strategy state: {name} is {type(saved).__name__}, not {type(fresh).__name__}"
        )
