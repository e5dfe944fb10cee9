"""Which classes may appear in checkpointed strategy state.

Checkpoints are loaded with torch's `weights_only` unpickler, which rebuilds tensors,
numbers, strings and containers, and objects only of classes on this list: a crafted
checkpoint cannot run code. A strategy whose `state_attributes` hold its own objects
marks their classes with `@checkpointable`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
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


FINITE, INF_OK, NAN_OK = "finite", "inf-ok", "nan-ok"  # what a value may hold


def check_state_values(name: str, state: Any, nan_ok: Collection[str] = ()) -> None:
    """Every number in `state` is finite: floats, floating tensors and arrays, through
    containers and state classes. A checkpoint is untrusted and a NaN it plants would reach
    a controller (ASFL's agent, FedSU's slopes) and crash or stall the run; ValueError
    naming the first path that holds one.

    Sentinels are declared, never guessed: a state class's `SENTINELS` fields may hold ±inf
    ("no minimum yet"), never NaN; the entries of `state` named in `nan_ok` (a strategy's
    `nan_sentinels`, e.g. R2SP's "not measured yet") may hold NaN, never ±inf."""
    stack: list[tuple[str, Any, str]] = [(name, state, FINITE)]
    if isinstance(state, Mapping) and nan_ok:
        stack = [
            (_join(name, _label(k)), v, NAN_OK if k in nan_ok else FINITE) for k, v in state.items()
        ]
    seen: set[int] = set()
    while stack:
        where, value, mode = stack.pop()
        if isinstance(value, float | np.floating | torch.Tensor | np.ndarray):
            if not _fits(value, mode):
                raise ValueError(f"strategy state: {where} has NaN or Inf values")
            continue
        if id(value) in seen:  # a shared or cyclic container is walked once
            continue
        seen.add(id(value))
        stack.extend(_parts(where, value, mode))


def _fits(value: float | np.floating | torch.Tensor | np.ndarray, mode: str) -> bool:
    """Whether a leaf holds only what `mode` allows (non-floating tensors: anything)."""
    if isinstance(value, float | np.floating):
        nan, inf = math.isnan(value), math.isinf(value)
    elif isinstance(value, torch.Tensor):
        if not (value.is_floating_point() or value.is_complex()):
            return True
        nan, inf = bool(torch.isnan(value).any()), bool(torch.isinf(value).any())
    else:
        if value.dtype.kind not in "fc":
            return True
        nan, inf = bool(np.isnan(value).any()), bool(np.isinf(value).any())
    return not (nan and mode != NAN_OK) and not (inf and mode != INF_OK)


def _parts(where: str, value: Any, mode: str) -> list[tuple[str, Any, str]]:
    """The named parts of a container (in its mode) or state class (each field finite, or
    ±inf where the class lists it in `SENTINELS`); none for a leaf."""
    if isinstance(value, Mapping):
        keys = [(_join(where, "(a key)"), k, FINITE) for k in value]
        return keys + [(_join(where, _label(k)), v, mode) for k, v in value.items()]
    if isinstance(value, list | tuple | set | frozenset):
        return [(f"{where}[{i}]", v, mode) for i, v in enumerate(value)]
    sentinels = getattr(type(value), "SENTINELS", ())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        fields = [(n, getattr(value, n)) for n in names]
    elif isinstance(value, tuple(_STATE_TYPES)):
        fields = list(vars(value).items())
    else:
        return []
    return [(_join(where, n), v, INF_OK if n in sentinels else FINITE) for n, v in fields]


def _join(where: str, part: str) -> str:
    return f"{where}.{part}" if where else part


def _label(key: Any) -> str:
    """A key as a path part, short whatever a file planted."""
    return shown(key, 40) if isinstance(key, str | int) else type(key).__name__
