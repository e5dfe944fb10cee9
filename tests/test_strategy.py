"""The server half: per-node messages, weighted aggregation, and rejection of bad replies."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl.codec import encode_dense
from fl.engines.local import LocalGrid
from fl.records import Layout
from fl.strategy import ServerStrategy
from strategies.fedavg import FedAvgParams

GLOBAL = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
LAYOUT = Layout.of(GLOBAL)


def _client(behaviour: dict[int, str]) -> ClientApp:
    """A ClientApp whose partition p replies with all values = p + 1, or misbehaves."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        p = int(context.node_config["partition-id"])
        vector = torch.full((LAYOUT.numel,), float(p + 1))
        kind = behaviour.get(p, "good")
        if kind == "crash":
            raise RuntimeError("client exploded")
        if kind == "nan":
            vector[0] = math.nan
        records: dict = encode_dense(vector, LAYOUT)
        if kind == "shape":
            records["arrays"] = ArrayRecord({"w": torch.zeros(3, 3), "b": torch.zeros(2)})
        if kind == "huge":
            records = encode_dense(torch.full((LAYOUT.numel,), 1e9), LAYOUT)
        metrics = {"num-examples": p + 1, "train-loss": 1.0}
        if kind == "no-examples":
            metrics = {"train-loss": 1.0}
        return Message(RecordDict({**records, "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def _round(behaviour: dict[int, str], num_nodes: int = 4, **kwargs):
    grid = LocalGrid(_client(behaviour), num_nodes, {})
    strategy = ServerStrategy(FedAvgParams(), seed=0, clients_per_round=num_nodes, **kwargs)
    messages = list(strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    arrays, metrics = strategy.aggregate_train(1, replies)
    return strategy, arrays, metrics


def test_aggregate_is_example_weighted_mean():
    strategy, arrays, metrics = _round({})
    # partitions 0..3 send value p+1 with weight p+1: sum(w^2)/sum(w) = 30/10
    assert torch.allclose(LAYOUT.flatten(arrays.to_torch_state_dict()), torch.full((6,), 3.0))
    assert metrics["num-examples"] == 10
    assert strategy.stats.accepted == 4 and strategy.stats.rejected == 0


@pytest.mark.parametrize("kind", ["nan", "shape", "no-examples"])
def test_bad_replies_are_rejected_and_never_aggregated(kind):
    strategy, arrays, _ = _round({3: kind})
    # without partition 3 (value 4, weight 4): (1 + 4 + 9) / 6
    expected = 14 / 6
    assert torch.allclose(LAYOUT.flatten(arrays.to_torch_state_dict()), torch.full((6,), expected))
    assert strategy.stats.rejected == 1 and strategy.stats.accepted == 3
    assert strategy.diagnostics()["rejected"] == 1


def test_absurd_norm_is_rejected_when_bounded():
    strategy, arrays, _ = _round({0: "huge"}, max_update_norm=1e3)
    assert strategy.stats.rejected == 1
    assert "exceeds max_update_norm" in strategy.stats.reasons[0]
    assert LAYOUT.flatten(arrays.to_torch_state_dict()).max() < 10


def test_crashed_client_is_counted_and_round_continues():
    strategy, arrays, _ = _round({1: "crash"})
    assert strategy.stats.failed == 1 and strategy.stats.accepted == 3
    assert arrays is not None


def test_all_rejected_leaves_global_model_untouched():
    strategy, arrays, metrics = _round({p: "nan" for p in range(4)})
    assert arrays is None and metrics is None
    assert torch.equal(strategy.global_vector, torch.zeros(6))


def test_selection_is_seeded_and_per_node_config_is_sent():
    class PerNode(ServerStrategy):
        def train_config(self, server_round, node_id):
            return {"batch-size": node_id % 7 + 1}

    grid = LocalGrid(_client({}), 20, {})
    strategy = PerNode(FedAvgParams(), seed=5, clients_per_round=6)
    first = list(strategy.configure_train(3, ArrayRecord(GLOBAL), ConfigRecord({"lr": 0.1}), grid))
    again = list(strategy.configure_train(3, ArrayRecord(GLOBAL), ConfigRecord({"lr": 0.1}), grid))
    other = list(strategy.configure_train(4, ArrayRecord(GLOBAL), ConfigRecord({"lr": 0.1}), grid))
    ids = [m.metadata.dst_node_id for m in first]
    assert len(ids) == 6 and ids == [m.metadata.dst_node_id for m in again]
    assert ids != [m.metadata.dst_node_id for m in other]
    for m in first:
        config = m.content.config_records["config"]
        assert config["batch-size"] == m.metadata.dst_node_id % 7 + 1
        assert config["server-round"] == 3 and config["lr"] == 0.1
