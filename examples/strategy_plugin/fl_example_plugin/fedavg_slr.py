"""FedAvg with a server learning rate: the global model moves `server_lr` of the way to the mean.

server_lr = 1 is FedAvg; below 1 damps each round's step (Reddi et al., 2021, FedOpt with
SGD as the server optimizer). Its Hydra config is `conf/strategy/fedavg_slr.yaml` beside
this module; adaptive-fl's search-path plugin finds it through the entry point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl.api import ClientHooks, ClientUpdate, ServerStrategy, register  # the public API


@dataclass
class SLRParams:
    """server_lr: fraction of the step from the global model to the clients' mean."""

    server_lr: float = 1.0

    def validate(self) -> None:
        if not 0 < self.server_lr <= 1:
            raise ValueError(f"strategy.server_lr must be in (0, 1], got {self.server_lr}")


class SLRServer(ServerStrategy):
    """The configured aggregation's result, reached by a step of `server_lr`."""

    params: SLRParams

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        mean = super().aggregate(server_round, updates)
        return self.global_vector + self.params.server_lr * (mean - self.global_vector)


STRATEGY = register("fedavg_slr", server=SLRServer, client=ClientHooks, params=SLRParams)
