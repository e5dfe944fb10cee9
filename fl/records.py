"""Conversions between a model's state_dict, one flat vector and Flower's ArrayRecord.

Aggregation, masks and codecs all work on one flat float vector per model; `Layout`
remembers names, shapes and dtypes so the vector can become a state_dict again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord

__all__ = ["Layout", "arrays_to_vector", "vector_to_arrays"]


@dataclass(frozen=True)
class Layout:
    """Names, shapes and dtypes of a state_dict, in order: the key to its flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> Layout:
        """Layout of a state_dict (or any name -> tensor mapping)."""
        return cls(
            tuple(state),
            tuple(tuple(t.shape) for t in state.values()),
            tuple(t.dtype for t in state.values()),
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of scalars of each tensor."""
        return tuple(int(np.prod(s)) for s in self.shapes)

    @property
    def numel(self) -> int:
        """Number of scalars in the whole model."""
        return sum(self.sizes)

    def flatten(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One float32 vector holding every tensor of `state`, in layout order."""
        self.check(state)
        return torch.cat([state[n].detach().reshape(-1).float() for n in self.names])

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state_dict whose flat form is `vector` (views where dtypes allow)."""
        if vector.numel() != self.numel:
            raise ValueError(f"vector has {vector.numel()} scalars, layout expects {self.numel}")
        parts = torch.split(vector, list(self.sizes))
        return {
            name: part.reshape(shape).to(dtype)
            for name, part, shape, dtype in zip(
                self.names, parts, self.shapes, self.dtypes, strict=True
            )
        }

    def check(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError naming the first key, shape or dtype that does not match."""
        missing = [n for n in self.names if n not in state]
        extra = [n for n in state if n not in self.names]
        if missing or extra:
            raise ValueError(f"keys differ from the model: missing {missing}, extra {extra}")
        for name, shape in zip(self.names, self.shapes, strict=True):
            if tuple(state[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(state[name].shape)}, expected {shape}")


def arrays_to_vector(arrays: ArrayRecord, layout: Layout) -> torch.Tensor:
    """Flat float32 vector of a dense ArrayRecord, checked against `layout`."""
    state = {name: torch.from_numpy(arrays[name].numpy()) for name in arrays}
    return layout.flatten(state)


def vector_to_arrays(vector: torch.Tensor, layout: Layout) -> ArrayRecord:
    """Dense ArrayRecord (one Array per tensor, Flower-compatible) of a flat vector."""
    return ArrayRecord({k: v.contiguous() for k, v in layout.unflatten(vector).items()})
