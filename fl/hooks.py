"""The client half of a strategy: the points where it may change local training.

The trainer in `clients/` owns the loop and calls these hooks; the defaults are plain
local SGD sending a dense model, i.e. FedAvg. `state` is the node's persistent
`Context.state`, so anything a strategy keeps there survives across rounds on every
engine.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from fl.codec import decode, encode_dense
from fl.records import Layout

__all__ = ["ClientHooks", "Reply"]

Reply = tuple[dict[str, ArrayRecord | ConfigRecord], dict[str, float | int]]


class ClientHooks:
    """Default client behaviour; a strategy overrides only what differs."""

    def __init__(self, params: Any) -> None:
        self.params = params

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        """Put the global model the server sent into `model`."""
        layout.load_into(model, decode(content, layout))

    def begin(self, model: nn.Module, config: ConfigRecord, state: RecordDict) -> None:
        """Called once the global model is loaded, before the first local step."""

    def lr(self, step: int, base_lr: float) -> float:
        """Learning rate for local step `step` (0-based)."""
        return base_lr

    def batch_size(self, step: int, base: int) -> int:
        """Batch size for local step `step`."""
        return base

    def before_step(self, model: nn.Module) -> None:
        """Shape gradients after backward, before the optimizer step (e.g. FedProx)."""

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
        """Called after each optimizer step; return False to stop local training early."""
        return True

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        """Encode the reply payload and add strategy metrics."""
        return encode_dense(layout.flatten(model.state_dict()), layout), {}
