"""FedBuff / FedAsync: plain staleness-weighted asynchronous FedAvg, with a server step.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022;
Xie et al., "Asynchronous Federated Optimization" (FedAsync), 2019. Run on the
`semi_async` loop: a round closes at the `loop.buffer_k`-th arrival (FedBuff's buffer of
K updates; `loop.buffer_k=1` is FedAsync), every stale step is scaled by the loop's
(1 + s)^-a on arrival (`ServerStrategy.rebase`), and the server moves the global model
by `server_lr` times the example-weighted mean of the buffered steps. Everything but the
server step is the base class: the baselines ASFL is compared with (spec §1.5).
"""

from dataclasses import dataclass

import torch

from fl.strategy.client import ClientHooks
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy


@dataclass
class FedBuffParams:
    """FedBuff's server learning rate η_g (1.0: the buffered steps' mean, as FedAvg)."""

    server_lr: float = 1.0

    def validate(self) -> None:
        if not self.server_lr > 0:
            raise ValueError("strategy.server_lr must be > 0")


class FedBuffServer(ServerStrategy):
    """The configured aggregation rule of the rebased replies, taken as a server step."""

    params: FedBuffParams
    loop_kinds = ("semi_async",)  # the buffer is the semi-async loop's buffer_k

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        mean = super().aggregate(server_round, updates)
        return self.global_vector + self.params.server_lr * (mean - self.global_vector)


STRATEGY = register("fedbuff", server=FedBuffServer, client=ClientHooks, params=FedBuffParams)
