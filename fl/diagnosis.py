"""Training diagnosis: pure functions and small state of model-update statistics.

Strategies (and metric grafting) compose these with their own actions; nothing here
decides anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PerturbationEMA"]


@dataclass
class PerturbationEMA:
    """APF's effective perturbation, EMA form: P = |EMA(delta)| / EMA(|delta|) per scalar.

    P is 0 for updates that cancel out (a scalar zig-zagging around a fixed value) and 1
    for updates that all point one way. Chen et al., TPDS 2023, eq. 17.
    """

    alpha: float
    signed: torch.Tensor  # E: EMA of the updates
    magnitude: torch.Tensor  # A: EMA of their absolute values

    @classmethod
    def zeros(cls, numel: int, alpha: float) -> PerturbationEMA:
        """Fresh statistics: the first update then gives P = 1."""
        return cls(alpha, torch.zeros(numel), torch.zeros(numel))

    def update(self, delta: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """Fold `delta` into the scalars selected by `where`; return P for those scalars.

        Where the magnitude is still 0 (a scalar that never moved) P is defined as 1:
        the authors' code divides by zero there and so treats it as unstable.
        """
        a = self.alpha
        self.signed[where] = a * self.signed[where] + (1 - a) * delta[where]
        self.magnitude[where] = a * self.magnitude[where] + (1 - a) * delta[where].abs()
        magnitude = self.magnitude[where]
        ratio = self.signed[where].abs() / magnitude.clamp_min(torch.finfo(magnitude.dtype).tiny)
        return torch.where(magnitude > 0, ratio, torch.ones_like(ratio))
