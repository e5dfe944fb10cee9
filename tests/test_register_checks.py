"""register() checks a strategy's halves when it is registered, not at a run's first call."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from flwr.serverapp.strategy import FedAvgM

from fl.strategy.client import ClientHooks
from fl.strategy.registry import StrategySpec, get_strategy, register
from fl.strategy.server import ServerStrategy


@dataclass
class Params:
    """No parameters."""


def test_a_flower_strategy_as_server_half_points_to_the_adapter():
    with pytest.raises(TypeError) as err:
        register("my_fedavgm", server=FedAvgM, client=ClientHooks, params=Params)
    message = str(err.value)
    assert message.startswith(
        "strategy 'my_fedavgm': server=FedAvgM is not a subclass of "
        "fl.strategy.server.ServerStrategy; it is a Flower strategy: run it through our "
        "adapter with `fl-run strategy=flower strategy.flower_class=FedAvgM`"
    )
    with pytest.raises(ValueError, match="unknown strategy 'my_fedavgm'"):
        get_strategy("my_fedavgm")  # nothing was registered


@pytest.mark.parametrize(
    ("halves", "message"),
    [
        (
            {"server": object, "client": ClientHooks, "params": Params},
            "server=object is not a subclass of fl.strategy.server.ServerStrategy (a server",
        ),
        (
            {"server": ServerStrategy(Params(), seed=0, clients_per_round=1)},
            "is not a subclass of fl.strategy.server.ServerStrategy",
        ),
        (
            {"server": ServerStrategy, "client": ServerStrategy, "params": Params},
            "client=ServerStrategy is not a subclass of fl.strategy.client.ClientHooks",
        ),
        (
            {"server": ServerStrategy, "client": ClientHooks, "params": dict},
            "params=dict must be a dataclass",
        ),
    ],
)
def test_a_class_of_the_wrong_kind_is_refused_by_name(halves, message):
    kwargs = {"server": ServerStrategy, "client": ClientHooks, "params": Params, **halves}
    with pytest.raises(TypeError, match=r"^strategy 'wrong': ") as err:
        register("wrong", **kwargs)
    assert message in str(err.value)


def test_right_halves_register_and_the_server_names_itself():
    spec = register("checked_ok", server=ServerStrategy, client=ClientHooks, params=Params)
    assert isinstance(spec, StrategySpec) and get_strategy("checked_ok") is spec
    assert spec.server(Params(), seed=0, clients_per_round=1).strategy_name == "checked_ok"
