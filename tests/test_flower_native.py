"""strategy=flower: Flower's own strategy classes aggregate, our loop validates and counts."""

from __future__ import annotations

import gc
import subprocess

import pytest
import torch
from conftest import REPO, fl_env, fl_run_cmd, python_run, read_metrics, run_fl, without_wall_time
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from netns import in_netns, require_netns
from torch import nn

from fl.common.config import ConfigError, compose
from fl.run.checkpoint import load_checkpoint, save_checkpoint
from fl.run.engines.local import LocalGrid
from fl.run.validation import validate
from fl.wire.codec import encode_dense
from fl.wire.records import Layout
from strategies.flower import SUPPORTED, FlowerHooks, FlowerParams, FlowerStrategy, flower_class

GLOBAL = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
LAYOUT = Layout.of(GLOBAL)
NODES = 7  # Bulyan tolerates f = 1 with 4f + 3 = 7 replies
KWARGS: dict[str, dict] = {
    "FedAvgM": {"server_momentum": 0.9, "server_learning_rate": 0.5},
    "FedProx": {"proximal_mu": 0.1},
    "FedAdam": {"eta": 0.05},
    "FedAdagrad": {"eta": 0.05},
    "FedYogi": {"eta": 0.05},
    "FedTrimmedAvg": {"beta": 0.2},
    "Krum": {"num_malicious_nodes": 1},
    "MultiKrum": {"num_malicious_nodes": 1, "num_nodes_to_select": 3},
    "Bulyan": {"num_malicious_nodes": 1},
    "QFedAvg": {"client_learning_rate": 0.1, "q": 0.2},
}
RUN = ["num_clients=4", "clients_per_round=4", "local_epochs=1", "task=digits"]


def _client() -> ClientApp:
    """Partition p moves each scalar i of the model it got by _scale(p) * cos(i + round) / 10.
    Loss and example counts differ per partition."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        p = int(context.node_config["partition-id"])
        rnd = int(msg.content.config_records["config"]["server-round"])
        model = LAYOUT.flatten(msg.content.array_records["arrays"].to_torch_state_dict())
        vector = model + _step(rnd) * _scale(p)
        metrics = MetricRecord({"num-examples": 10 + p, "train-loss": 1.0 + p / 10})
        records = {**encode_dense(vector, LAYOUT), "metrics": metrics}
        return Message(RecordDict(records), reply_to=msg)

    return app


def _scale(p: int) -> float:
    """Squares (no ties among Krum's distance scores); partition 6 is an outlier."""
    return (p + 1) ** 2 * (20 if p == 6 else 1)


def _step(rnd: int) -> torch.Tensor:
    return torch.cos(torch.arange(LAYOUT.numel, dtype=torch.float32) + rnd) / 10


def _mean_scale() -> float:
    """FedAvg's example-weighted mean of the partitions' scales (weights 10 + p)."""
    return sum((10 + p) * _scale(p) for p in range(NODES)) / sum(10 + p for p in range(NODES))


def _ours(name: str, rounds: int, state: dict | None = None, start: int = 1, arrays=None):
    """Rounds `start`..`rounds` of our adapter on a local grid; (global, strategy)."""
    params = FlowerParams(name, KWARGS.get(name, {}))
    params.validate()
    strategy = FlowerStrategy(params, seed=0, clients_per_round=NODES)
    if state is not None:
        strategy.load_state_dict(state)
    grid = LocalGrid(_client(), NODES, {})
    arrays = arrays or ArrayRecord(GLOBAL)
    for rnd in range(start, rounds + 1):
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
        new, _ = strategy.aggregate_train(rnd, grid.send_and_receive(messages))
        arrays = new if new is not None else arrays
    return arrays, strategy


def _flowers_own(name: str, rounds: int) -> ArrayRecord:
    """The same class in Flower's own loop (`Strategy.start`) on the same clients."""
    own = flower_class(name)(
        **KWARGS.get(name, {}),
        **({"train_loss_key": "train-loss"} if name == "QFedAvg" else {}),
        fraction_evaluate=0.0,
        min_train_nodes=NODES,
        min_available_nodes=NODES,
    )
    grid = LocalGrid(_client(), NODES, {})
    gc.freeze()  # QFedAvg and Bulyan run gc.collect() per reply (see strategies.flower)
    try:
        return own.start(grid=grid, initial_arrays=ArrayRecord(GLOBAL), num_rounds=rounds).arrays
    finally:
        gc.unfreeze()


def _vector(arrays: ArrayRecord) -> torch.Tensor:
    return LAYOUT.flatten(arrays.to_torch_state_dict())


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_each_flower_class_matches_flowers_own_loop(name):
    # Three rounds: server-side optimizer state (momentum, Adam moments) carries over.
    ours, strategy = _ours(name, 3)
    reference = _flowers_own(name, 3)
    assert strategy.stats.accepted == NODES and strategy.stats.rejected == 0
    # Flower samples nodes in random order: sums may differ in the last float32 bits
    assert torch.allclose(_vector(ours), _vector(reference), rtol=1e-5, atol=1e-6)
    assert not torch.equal(_vector(ours), torch.zeros(LAYOUT.numel))


def test_robust_classes_ignore_the_outlier_and_fedavg_does_not():
    krum, _ = _ours("Krum", 1)
    mean, _ = _ours("FedAvg", 1)
    # Krum picks one honest client's model: _scale(p) * step for some p < 6
    scales = _vector(krum) / _step(1)
    assert torch.allclose(scales, scales[0].expand_as(scales))
    assert float(scales[0]) in {float(_scale(p)) for p in range(6)}
    assert torch.allclose(_vector(mean), _step(1) * _mean_scale(), rtol=1e-5)


def test_fedavgm_momentum_by_hand():
    # Every client moves the model by d; FedAvg's mean moves it by d; FedAvgM with lr 0.5 and
    # momentum 0.9: m1 = -d, m2 = 0.9 m1 - d, m3 = 0.9 m2 - d; w += -0.5 m each round.
    ours, _ = _ours("FedAvgM", 3)
    w, m = torch.zeros(LAYOUT.numel), torch.zeros(LAYOUT.numel)
    for rnd in (1, 2, 3):
        d = _step(rnd) * _mean_scale()
        m = -d if rnd == 1 else 0.9 * m - d
        w = w - 0.5 * m
    assert torch.allclose(_vector(ours), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_resume_continues_exactly(name, tmp_path):
    # Two rounds, a checkpoint through the real weights_only loader, a fresh strategy, one
    # more round: the same model as three rounds straight.
    straight, _ = _ours(name, 3)
    arrays, strategy = _ours(name, 2)
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"strategy": strategy.state_dict(), "arrays": {}, **_REQUIRED})
    state = load_checkpoint(path)["strategy"]
    assert set(state["flower"]) == set(SUPPORTED[name])
    resumed, _ = _ours(name, 3, state=state, start=3, arrays=arrays)
    assert torch.equal(_vector(resumed), _vector(straight))


_REQUIRED = {"config": {}, "progress": {}, "rows": [], "nodes": None, "rng": {}}


def test_fedprox_mu_reaches_the_client_hooks():
    # Flower's FedProx writes `proximal-mu` into its config: it reaches each instruction,
    # and our client half adds mu * (w - w_global) to the gradient.
    _, strategy = _ours("FedProx", 1)
    grid = LocalGrid(_client(), 2, {})
    message = next(iter(strategy.configure_train(2, ArrayRecord(GLOBAL), ConfigRecord(), grid)))
    config = message.content.config_records["config"]
    assert config["proximal-mu"] == pytest.approx(0.1)
    model = nn.Linear(2, 1)
    hooks = FlowerHooks(FlowerParams())
    hooks.begin(model, config, RecordDict())
    with torch.no_grad():
        model.weight += 1.0
    model.weight.grad = torch.zeros_like(model.weight)
    hooks.before_step(model)
    assert torch.allclose(model.weight.grad, torch.full_like(model.weight, 0.1))
    plain = FlowerHooks(FlowerParams())  # no proximal-mu: plain SGD, gradients untouched
    plain.begin(model, ConfigRecord({"server-round": 1}), RecordDict())
    plain.before_step(model)
    assert torch.allclose(model.weight.grad, torch.full_like(model.weight, 0.1))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.flower_class=FedNope"], "strategy.flower_class: 'FedNope' is not"),
        (["+strategy.kwargs={momentum:0.9}"], "strategy.kwargs.momentum: FedAvg has no such"),
        (
            ["strategy.flower_class=FedAvgM", "+strategy.kwargs.server_momentum=fast"],
            "strategy.kwargs.server_momentum='fast': FedAvgM expects a finite number",
        ),
        (["+strategy.kwargs.fraction_train=0.5"], "strategy.kwargs.fraction_train: set by our"),
        (["strategy.flower_class=QFedAvg"], "strategy.kwargs.client_learning_rate: required"),
        (
            ["strategy.flower_class=FedTrimmedAvg", "+strategy.kwargs.beta=0.7"],
            "FedTrimmedAvg refused them: `beta` must be in the range",
        ),
        (
            ["strategy.flower_class=Bulyan", "+strategy.kwargs.num_malicious_nodes=1"],
            "clients_per_round=4: Bulyan with num_malicious_nodes=1 needs >= 7",
        ),
        (["aggregation=median"], "aggregation='median': strategy=flower aggregates with"),
    ],
)
def test_bad_config_fails_naming_the_key(overrides, message):
    cfg = compose(["strategy=flower", *RUN, *overrides])
    with pytest.raises(ConfigError, match=r"^invalid config: ") as err:
        validate(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fl_run_fedavgm_trains_counts_bytes_and_resumes(tmp_path):
    run = [*RUN, "strategy=flower", "strategy.flower_class=FedAvgM"]
    run += ["+strategy.kwargs.server_momentum=0.5"]
    run_fl(tmp_path / "straight", *run, "rounds=2")
    run_fl(tmp_path / "resumed", *run, "rounds=1")
    run_fl(tmp_path / "resumed", *run, "rounds=2", "resume=true")
    rows = read_metrics(tmp_path / "straight")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(rows)
    dense = 4 * 4810 * 4  # 4 clients x MLP 64-64-10 (4,810 float32 parameters), each way
    assert all(r["bytes_up"] == r["bytes_down"] == dense for r in rows)
    assert all(r["replies"] == 4 and r["rejected"] == 0 for r in rows)
    assert rows[-1]["accuracy"] > 0.3  # 10 classes: chance is 0.1


def test_fl_run_refuses_a_bad_kwarg_in_one_line(tmp_path):
    proc = python_run(
        fl_run_cmd(f"hydra.run.dir={tmp_path}", *RUN, "strategy=flower", "+strategy.kwargs.eta=1")
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "fl-run: invalid config: strategy: strategy.kwargs.eta: FedAvg has no such argument; "
        "known: []"
    )
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow  # Ray start-up
@pytest.mark.integration
def test_flower_sim_engine_matches_local_engine(tmp_path):
    require_netns()  # Ray probes 8.8.8.8 on start: loopback only
    run = [*RUN, "rounds=2", "strategy=flower", "strategy.flower_class=FedAdam"]
    run += ["+strategy.kwargs.eta=0.01"]
    cmd = fl_run_cmd(f"hydra.run.dir={tmp_path / 'sim'}", *run, "engine=flower-sim")
    proc = subprocess.run(
        in_netns(cmd), cwd=REPO, env=fl_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_fl(tmp_path / "local", *run)
    sim, local = read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "local")
    for key in ("accuracy", "loss", "bytes_up", "bytes_down", "virtual_time_s"):
        assert [r[key] for r in sim] == [r[key] for r in local], key
