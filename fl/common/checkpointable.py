"""Which classes may appear in checkpointed strategy state.

Checkpoints are loaded with torch's `weights_only` unpickler, which rebuilds tensors,
numbers, strings and containers, and objects only of classes on this list: a crafted
checkpoint cannot run code. A strategy whose `state_attributes` hold its own objects
marks their classes with `@checkpointable`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from fl.common.text import shown

__all__ = ["check_state_kind", "check_state_values", "checkpointable", "state_types"]

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


def check_state_values(name: str, state: Any) -> None:
    """Every number in `state` is finite: floats, floating tensors and arrays, through
    containers and state classes. A checkpoint is untrusted and a NaN it plants would reach
    a controller (ASFL's agent, FedSU's slopes) and crash or stall the run; ValueError
    naming the first path that holds one. A state class may name fields where ±inf is a
    sentinel ("no minimum yet") in a `SENTINELS` class attribute: those must not be NaN."""
    stack: list[tuple[str, Any, bool]] = [(name, state, False)]
    seen: set[int] = set()
    while stack:
        where, value, sentinel = stack.pop()
        if isinstance(value, float):
            finite = not math.isnan(value) if sentinel else math.isfinite(value)
        elif isinstance(value, torch.Tensor):
            floating = value.is_floating_point() or value.is_complex()
            ok = torch.isnan(value).logical_not() if sentinel else torch.isfinite(value)
            finite = not floating or bool(ok.all())
        elif isinstance(value, np.ndarray):
            floating = value.dtype.kind in "fc"
            finite = not floating or bool(
                (~np.isnan(value) if sentinel else np.isfinite(value)).all()
            )
        else:
            finite = True
            if id(value) in seen:  # a shared or cyclic container is walked once
                continue
            seen.add(id(value))
            stack.extend(_parts(where, value))
        if not finite:
            raise ValueError(f"strategy state: {where} has NaN or Inf values")


def _parts(where: str, value: Any) -> list[tuple[str, Any, bool]]:
    """The named parts of a container or state class (none for a leaf), each with whether
    ±inf is its sentinel."""
    if isinstance(value, Mapping):
        keys = [(_join(where, "(a key)"), k, False) for k in value]
        return keys + [(_join(where, _label(k)), v, False) for k, v in value.items()]
    if isinstance(value, list | tuple | set | frozenset):
        return [(f"{where}[{i}]", v, False) for i, v in enumerate(value)]
    sentinels = getattr(type(value), "SENTINELS", ())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        return [(_join(where, n), getattr(value, n), n in sentinels) for n in names]
    if isinstance(value, tuple(_STATE_TYPES)):
        return [(_join(where, k), v, k in sentinels) for k, v in vars(value).items()]
    return []


def _join(where: str, part: str) -> str:
    return f"{where}.{part}" if where else part


def _label(key: Any) -> str:
    """A key as a path part, short whatever a file planted."""
    return shown(key, 40) if isinstance(key, str | int) else type(key).__name__
