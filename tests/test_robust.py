"""Robust aggregation: each rule against Flower's own strategy, its use by every strategy,
config validation, and a real run under attack with the example bound on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_fl
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum

from fl.common.config import ConfigError, compose
from fl.mechanisms.robust import Aggregator, ExampleBounds, example_bounds, robust_options
from fl.run.engines.local import LocalGrid
from fl.run.validation import validate
from fl.strategy.server import ClientUpdate
from strategies.gift import GIFTParams, GIFTServer

SHAPES = {"w": (3, 4), "b": (4,)}


def _vectors(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n honest-ish vectors around 1 plus two outliers, and distinct example counts."""
    rng = np.random.default_rng(seed)
    rows = 1 + 0.1 * rng.standard_normal((n, 16)).astype(np.float32)
    rows[0] += 50
    rows[1] -= 30
    weights = rng.integers(1, 100, n)
    return torch.from_numpy(rows), torch.from_numpy(weights).double()


def _flower(strategy: Any, vectors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Flower's message-API strategy on the same inputs, split into two named tensors."""
    LocalGrid(None, 1, {})  # type: ignore[arg-type]  # sets Flower's task identity
    replies = []
    for node, (row, weight) in enumerate(zip(vectors.numpy(), weights, strict=True), start=1):
        arrays = ArrayRecord({"w": Array(row[:12].reshape(3, 4).copy()), "b": Array(row[12:])})
        metrics = MetricRecord({"num-examples": int(weight)})
        instruction = Message(RecordDict(), node, "train")
        content = RecordDict({"arrays": arrays, "metrics": metrics})
        replies.append(Message(content, reply_to=instruction))
    result, _ = strategy.aggregate_train(1, replies)
    state = cast(ArrayRecord, result).to_numpy_ndarrays()
    return torch.from_numpy(np.concatenate([a.ravel() for a in state]).astype(np.float32))


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (Aggregator("median"), FedMedian()),
        (Aggregator("trimmed_mean", trim_beta=0.2), FedTrimmedAvg(beta=0.2)),
        (Aggregator("krum", num_malicious=2), Krum(num_malicious_nodes=2)),
        (
            Aggregator("multikrum", num_malicious=2, num_selected=5),
            MultiKrum(num_malicious_nodes=2, num_nodes_to_select=5),
        ),
        (Aggregator("bulyan", num_malicious=2), Bulyan(num_malicious_nodes=2)),
    ],
    ids=["median", "trimmed_mean", "krum", "multikrum", "bulyan"],
)
def test_each_rule_gives_flowers_result_on_the_same_inputs(ours, theirs):
    vectors, weights = _vectors(11)
    expected = _flower(theirs, vectors, weights)
    got = ours(vectors, weights)
    assert got.dtype == torch.float32 and got.shape == (16,)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert (got - 1).abs().max() < 0.5  # and the outliers did not move it


def test_mean_is_the_example_weighted_mean_and_outliers_drag_it():
    vectors, weights = _vectors(11)
    got = Aggregator()(vectors, weights)
    expected = (weights / weights.sum()) @ vectors.double()
    assert torch.allclose(got.double(), expected, atol=1e-6)
    assert (got - 1).abs().max() > 1  # the outliers move the mean


def test_multikrum_averages_n_minus_f_by_default():
    vectors, weights = _vectors(11)
    got = Aggregator("multikrum", num_malicious=2)(vectors, weights)
    expected = _flower(MultiKrum(num_malicious_nodes=2, num_nodes_to_select=9), vectors, weights)
    assert torch.allclose(got, expected, atol=1e-6)


def test_a_strategy_overriding_aggregate_uses_the_configured_rule():
    """GIFT (which computes its consistency, then calls the base aggregate) gets the median."""
    server = GIFTServer(GIFTParams(), seed=0, clients_per_round=5, aggregator=Aggregator("median"))
    server.global_vector = torch.zeros(3)
    server.on_round_start(1)
    updates = [ClientUpdate(n, torch.full((3,), float(n)), 10, {}) for n in range(1, 5)]
    updates.append(ClientUpdate(5, torch.full((3,), 1e6), 10**6, {}))
    assert torch.equal(server.aggregate(1, updates), torch.full((3,), 3.0))
    mean = GIFTServer(GIFTParams(), seed=0, clients_per_round=5)
    mean.global_vector = torch.zeros(3)
    mean.on_round_start(1)
    assert float(mean.aggregate(1, updates)[0]) > 1e5


def test_example_bounds_are_partition_sizes_capped_by_the_configured_maximum():
    task = SimpleNamespace(sizes=np.array([5, 50, 500]))
    nodes = {11: 0, 12: 1, 13: 2}
    free = example_bounds(compose(), task, nodes)  # type: ignore[arg-type]
    assert free.per_node == {11: 5, 12: 50, 13: 500} and free.limit(99) is None
    capped = example_bounds(compose(["max_examples_per_client=100"]), task, nodes)  # type: ignore[arg-type]
    assert capped.per_node == {11: 5, 12: 50, 13: 100} and capped.limit(99) == 100
    # deployment without partition knowledge: the cap alone
    assert example_bounds(compose(["max_examples_per_client=7"]), None, nodes) == ExampleBounds(
        {11: 7, 12: 7, 13: 7}, 7
    )


def test_robust_options_come_from_the_aggregation_group():
    options = robust_options(compose(["aggregation=bulyan", "update_norm_policy=clip"]))
    assert options["aggregator"] == Aggregator("bulyan", num_malicious=4)
    assert options["update_norm_policy"] == "clip"
    assert robust_options(compose())["aggregator"] == Aggregator()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["aggregation=krum", "clients_per_round=10"], "clients_per_round=10"),
        (["aggregation=bulyan", "aggregation.num_malicious=5"], "clients_per_round=20"),
        (["aggregation=trimmed_mean", "aggregation.trim_beta=0.5"], "aggregation.trim_beta"),
        (["aggregation=multikrum", "aggregation.num_selected=0"], "aggregation.num_selected"),
        (["aggregation=krum", "aggregation.num_malicious=-1"], "aggregation.num_malicious"),
        (["aggregation.name=geomed"], "aggregation.name"),
        (["update_norm_policy=warn"], "update_norm_policy"),
        (["max_examples_per_client=0"], "max_examples_per_client"),
        (["faults.attack=flip"], "faults.attack"),
        (["faults=sign_flip", "faults.attack_rate=1.5"], "faults.attack_rate"),
    ],
)
def test_combinations_that_cannot_work_are_refused_before_round_one(overrides, key):
    with pytest.raises(ConfigError, match=key):
        validate(compose(overrides))


def test_krum_at_exactly_2f_plus_3_and_bulyan_at_4f_plus_3_are_accepted():
    validate(compose(["aggregation=krum", "clients_per_round=11"]))
    validate(compose(["aggregation=bulyan", "clients_per_round=19"]))


def test_a_round_with_too_few_replies_for_bulyan_keeps_the_global_model():
    from test_strategy import GLOBAL, LAYOUT, _client  # a 4-node federation

    from fl.strategy.server import ServerStrategy
    from strategies.fedavg import FedAvgParams

    grid = LocalGrid(_client({}), 4, {})
    strategy = ServerStrategy(
        FedAvgParams(),
        seed=0,
        clients_per_round=4,
        aggregator=Aggregator("bulyan", num_malicious=1),
    )
    messages = list(strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), grid))
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert arrays is None and metrics is None
    assert strategy.diagnostics()["aggregation_skipped"] == 1
    assert torch.equal(strategy.global_vector, torch.zeros(LAYOUT.numel))


TINY = ["rounds=12", "local_epochs=1"]


def test_inflated_example_counts_cannot_move_a_real_run(tmp_path):
    """20 % of the clients claim 10^12 examples: with the bound the run is the clean run."""
    run_fl(tmp_path / "clean", *TINY)
    run_fl(tmp_path / "attacked", *TINY, "faults=inflate_examples")
    clean, attacked = read_metrics(tmp_path / "clean"), read_metrics(tmp_path / "attacked")
    assert all(r["examples_clipped"] == 4 for r in attacked)  # 4 of 20 attack every round
    assert all(r["rejected"] == 0 for r in attacked)
    assert abs(attacked[-1]["accuracy"] - clean[-1]["accuracy"]) < 0.02
    assert attacked[-1]["accuracy"] > 0.8


@pytest.mark.slow
def test_median_recovers_from_sign_flipping_clients_that_break_the_mean(tmp_path):
    """4 of 20 clients send -10 x their update each round (the default 30-round run)."""
    run_fl(tmp_path / "clean")
    run_fl(tmp_path / "mean", "faults=sign_flip")
    run_fl(tmp_path / "median", "faults=sign_flip", "aggregation=median")
    clean, mean, median = (read_metrics(tmp_path / d)[-1] for d in ("clean", "mean", "median"))
    assert mean["accuracy"] < 0.3
    assert median["accuracy"] > clean["accuracy"] - 0.15
