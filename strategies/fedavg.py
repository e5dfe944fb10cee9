"""FedAvg (McMahan et al., 2017): example-weighted mean of local models."""

from dataclasses import dataclass

from fl.strategy.client import ClientHooks
from fl.strategy.registry import register
from fl.strategy.server import ServerStrategy


@dataclass
class FedAvgParams:
    """FedAvg has no hyper-parameters beyond the run's own (rounds, local steps, lr)."""


STRATEGY = register("fedavg", server=ServerStrategy, client=ClientHooks, params=FedAvgParams)
