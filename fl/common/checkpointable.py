"""Which classes may appear in checkpointed strategy state.

Checkpoints are loaded with torch's `weights_only` unpickler, which rebuilds tensors,
numbers, strings and containers, and objects only of classes on this list: a crafted
checkpoint cannot run code. A strategy whose `state_attributes` hold its own objects
marks their classes with `@checkpointable`.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["checkpointable", "state_types"]

T = TypeVar("T", bound=type)
_STATE_TYPES: list[type] = []


def checkpointable(cls: T) -> T:
    """Class decorator: instances may appear in checkpointed strategy state."""
    _STATE_TYPES.append(cls)
    return cls


def state_types() -> list[type]:
    """Every class marked `@checkpointable` so far (their modules are imported)."""
    return list(_STATE_TYPES)
