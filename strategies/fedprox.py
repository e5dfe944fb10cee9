"""FedProx (Li et al., 2020): local steps pulled towards the global model by mu/2 ||w - w_g||^2."""

from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from fl.strategy.client import ClientHooks
from fl.strategy.registry import register
from fl.strategy.server import ServerStrategy


@dataclass
class FedProxParams:
    """mu: weight of the proximal term (the paper tries 0.001 to 1)."""

    mu: float = 0.01

    def validate(self) -> None:
        if self.mu < 0:
            raise ValueError(f"strategy.mu must be >= 0, got {self.mu}")


class FedProxHooks(ClientHooks):
    """Adds the proximal term's gradient mu * (w - w_global) before every step; a cohort
    adds the same pull to each of its clients (`proximal_pull`)."""

    params: FedProxParams
    cohort_safe = True

    def begin(self, model: nn.Module, config: ConfigRecord, state: RecordDict) -> None:
        self.anchor = [p.detach().clone() for p in model.parameters()]

    def proximal_pull(self) -> tuple[float, list[torch.Tensor]]:
        return self.params.mu, self.anchor

    def before_step(self, model: nn.Module) -> None:
        mu, anchors = self.proximal_pull()
        with torch.no_grad():
            for p, anchor in zip(model.parameters(), anchors, strict=True):
                if p.grad is not None:
                    p.grad.add_(p - anchor, alpha=mu)


STRATEGY = register("fedprox", server=ServerStrategy, client=FedProxHooks, params=FedProxParams)
