"""Per-scalar freezing on the client: frozen scalars are rolled back after every step.

Masking gradients would still let momentum and weight decay move a scalar; rolling
back after the optimizer step keeps frozen scalars bit-identical, as APF, PAS and
FedSU do. Optimizer state is deliberately left alone, as in the authors' code.
"""

from __future__ import annotations

import torch
from torch import nn

from fl.wire.records import Layout

__all__ = ["Rollback"]


class Rollback:
    """Restores the scalars outside `active` to `frozen_values` in a model's tensors."""

    def __init__(
        self, model: nn.Module, layout: Layout, active: torch.Tensor, frozen_values: torch.Tensor
    ) -> None:
        state = model.state_dict()
        self._targets = []
        for name, keep, values in zip(
            layout.names,
            torch.split(active, list(layout.sizes)),
            torch.split(frozen_values, list(layout.sizes)),
            strict=True,
        ):
            if not bool(keep.all()):
                tensor = state[name]
                shaped_keep = keep.view(tensor.shape).to(tensor.device)
                self._targets.append((tensor, shaped_keep, values.view(tensor.shape).to(tensor)))

    @torch.no_grad()
    def __call__(self) -> None:
        """Put every frozen scalar back to its frozen value."""
        for tensor, keep, values in self._targets:
            tensor.copy_(torch.where(keep, tensor, values))
