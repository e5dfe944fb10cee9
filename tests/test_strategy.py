"""The server half: per-node messages, weighted aggregation, and rejection of bad replies."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl.mechanisms.robust import ExampleBounds
from fl.run.engines.local import LocalGrid
from fl.strategy.server import ServerStrategy
from fl.wire.codec import encode_dense
from fl.wire.records import Layout
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
        if kind == "reversed":  # a bounded, reversed update (norm 6 * 6 ** 0.5 = 14.7)
            records = encode_dense(torch.full((LAYOUT.numel,), -6.0), LAYOUT)
        metrics = {"num-examples": p + 1, "train-loss": 1.0}
        if kind in ("inflate", "reversed"):
            metrics["num-examples"] = 10**12
        if kind == "no-examples":
            metrics = {"train-loss": 1.0}
        return Message(RecordDict({**records, "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def _round(behaviour: dict[int, str], num_nodes: int = 4, bounded: bool = False, **kwargs):
    grid = LocalGrid(_client(behaviour), num_nodes, {})
    strategy = ServerStrategy(FedAvgParams(), seed=0, clients_per_round=num_nodes, **kwargs)
    if bounded:  # what the round loop sets: each node's partition size (here p + 1)
        partitions = dict(grid.nodes)
        strategy.bound_examples(ExampleBounds({n: p + 1 for n, p in partitions.items()}))
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


def _global(arrays) -> torch.Tensor:
    return LAYOUT.flatten(arrays.to_torch_state_dict())


def test_a_claim_of_a_trillion_examples_is_clipped_to_the_partition_size(caplog):
    # the reply of partition 3 is honest (value 4) but claims 10^12 examples
    _, arrays, _ = _round({3: "inflate"})
    assert _global(arrays)[0] == pytest.approx(4.0, abs=1e-6)  # the old behaviour: it decides
    with caplog.at_level("WARNING", logger="fl.strategy.server"):
        strategy, arrays, metrics = _round({3: "inflate"}, bounded=True)
    assert torch.allclose(_global(arrays), torch.full((6,), 3.0))  # the honest weighted mean
    assert metrics["num-examples"] == 10
    assert strategy.stats.accepted == 4 and strategy.stats.rejected == 0
    assert strategy.diagnostics()["examples_clipped"] == 1
    assert "claims 1000000000000 examples, more than the 4" in caplog.text


def test_a_bounded_reversed_update_with_an_inflated_claim_cannot_steer_the_model():
    # the finding: max_update_norm lets a small reversed update through, 10^12 weighs it
    _, arrays, _ = _round({3: "reversed"}, max_update_norm=20.0)
    assert _global(arrays)[0] < -5.9
    strategy, arrays, _ = _round({3: "reversed"}, bounded=True, max_update_norm=20.0)
    assert _global(arrays)[0] == pytest.approx((1 + 4 + 9 - 24) / 10)
    assert strategy.stats.examples_clipped == 1


def test_a_node_without_a_known_bound_weighs_at_most_the_median_claim():
    grid_nodes = LocalGrid(_client({}), 4, {}).nodes
    known = {n: p + 1 for n, p in grid_nodes.items()}
    loose = grid_nodes.by_partition[3]
    del known[loose]
    grid = LocalGrid(_client({3: "inflate"}), 4, {})
    strategy = ServerStrategy(FedAvgParams(), seed=0, clients_per_round=4)
    strategy.bound_examples(ExampleBounds(known))
    messages = list(strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), grid))
    arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    # claims 1, 2, 3, 10^12: the unbounded one is cut to the median claim, 2.5 -> 3
    assert torch.allclose(_global(arrays), torch.full((6,), (1 + 4 + 9 + 4 * 3) / 9))
    assert strategy.stats.examples_clipped == 1


@pytest.mark.parametrize("policy", ["reject", "clip"])
def test_update_norm_policy_rejects_or_clips_to_the_bound(policy):
    strategy, arrays, _ = _round({0: "huge"}, max_update_norm=1e3, update_norm_policy=policy)
    got = _global(arrays)
    if policy == "reject":
        assert strategy.stats.rejected == 1 and strategy.stats.norm_clipped == 0
        assert torch.allclose(got, torch.full((6,), 29 / 9))  # partitions 1..3 only
    else:
        assert strategy.stats.rejected == 0 and strategy.stats.norm_clipped == 1
        clipped = max((u.vector for u in strategy.stats.updates), key=lambda v: float(v[0]))
        assert float(torch.linalg.vector_norm(clipped)) == pytest.approx(1e3, rel=1e-5)
        assert torch.allclose(clipped, torch.full((6,), 1e3 / 6**0.5))
        assert torch.allclose(got, (clipped + 29) / 10)
        assert strategy.diagnostics()["norm_clipped"] == 1


def test_an_unknown_norm_policy_is_refused():
    with pytest.raises(ValueError, match="update_norm_policy"):
        ServerStrategy(FedAvgParams(), seed=0, clients_per_round=1, update_norm_policy="warn")
