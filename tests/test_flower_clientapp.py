"""Our ClientApp beside stock Flower: partitions from the node config, the contract check."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp.strategy import FedAvg

from clients.app import app as client_app
from fl.common.config import compose, to_run_config
from fl.run.engines.local import LocalGrid
from fl.wire.contract import CONTRACT_MISMATCH, ContractMismatch, stamp
from fl.world.task import get_task
from server.loop import run_training

SMALL = ["num_clients=3", "clients_per_round=3", "local_epochs=1"]


def _train(grid: LocalGrid, config: dict) -> list[Message]:
    """One train instruction per node, as a stock Flower FedAvg sends it."""
    task = get_task(compose(SMALL))
    flower = FedAvg(fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=3)
    arrays = ArrayRecord(task.new_model().state_dict())
    messages = flower.configure_train(1, arrays, ConfigRecord(config), grid)
    return sorted(grid.send_and_receive(messages), key=lambda r: r.metadata.src_node_id)


def test_stock_flower_server_without_our_run_config_uses_the_node_config():
    # No fl-config, no overrides: the run is our defaults split into num-partitions = 3.
    grid = LocalGrid(client_app, 3, {})
    replies = _train(grid, {})
    sizes = [len(p) for p in get_task(compose(SMALL)).partitions]
    got = {}
    for reply in replies:
        assert not reply.has_error(), reply.error.reason
        metrics = reply.content.metric_records["metrics"]
        got[metrics["partition-id"]] = metrics["num-examples"]
    assert got == dict(enumerate(sizes)) and len(sizes) == 3


class _NoNodeConfig(LocalGrid):
    """Nodes started without --node-config."""

    def context(self, node_id: int) -> Context:
        context = super().context(node_id)
        context.node_config = {}
        return context


def test_missing_node_config_fails_clearly():
    grid = _NoNodeConfig(client_app, 3, {})
    for reply in _train(grid, {}):
        assert reply.has_error()
        assert "num-partitions=None" in reply.error.reason
        assert "--node-config 'partition-id=0 num-partitions=10'" in reply.error.reason


def test_partition_id_outside_the_run_fails_clearly():
    grid = LocalGrid(
        client_app, 3, to_run_config(compose(["num_clients=2", "clients_per_round=2"]))
    )
    reasons = [r.error.reason for r in _train(grid, {}) if r.has_error()]
    assert reasons == ["ValueError: node config partition-id=2: the run has 2 clients"]


@pytest.mark.parametrize(
    ("keys", "reason"),
    [
        (stamp("apf"), "the server sends strategy=apf (contract 1), this ClientApp runs "),
        ({**stamp("fedavg"), "fl-contract": 2}, "strategy=fedavg (contract 2), this ClientApp"),
    ],
)
def test_an_instruction_for_another_half_gets_a_contract_error(keys, reason):
    grid = LocalGrid(client_app, 3, to_run_config(compose(SMALL)))
    replies = _train(grid, keys)
    assert all(r.error.code == CONTRACT_MISMATCH for r in replies)
    assert reason in replies[0].error.reason
    assert replies[0].error.reason.endswith("this ClientApp runs strategy=fedavg (contract 1)")
    # our own stamp is accepted
    assert not any(r.has_error() for r in _train(grid, stamp("fedavg")))


def test_apf_server_with_fedavg_clients_stops_naming_both(tmp_path):
    # Before: alternate rounds failed with CodecError and the run "succeeded".
    server = compose(["strategy=apf", *SMALL, "rounds=3", "progress=false"])
    grid = LocalGrid(client_app, 3, to_run_config(compose(SMALL)))
    with pytest.raises(ContractMismatch) as err:
        run_training(grid, server, tmp_path)
    message = str(err.value)
    assert "the server sends strategy=apf (contract 1)" in message
    assert "this ClientApp runs strategy=fedavg (contract 1); the run is stopped" in message
    assert not (tmp_path / "model.pt").exists()
