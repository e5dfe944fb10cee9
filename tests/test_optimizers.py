"""The client's optimizers (optimizer=sgd|momentum|adam|adamw) and their state across rounds.

Per client: two rounds of `train_locally` equal torch's own optimizer run by hand over the
same batches, its state carried from round to round; a cohort keeps each member's moments
within the cohort's tolerance of the per-client path; the state is checked as data when
read back, survives a kill and resume, and leaves APF's frozen scalars exactly frozen.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import train_in_process
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from test_resume import assert_resumes_identically
from torch import nn
from torch.nn import functional as F

from clients.cohort import METRIC_TOLERANCE, STEP_TOLERANCE, Member, train_cohort
from clients.optimizers import MOMENTS, STATE_KEY, OptimizerState
from clients.trainer import TrainSettings, train_locally
from fl.common.config import ConfigError, compose
from fl.run.engines.local import LocalGrid
from fl.run.settings import OPTIMIZERS
from fl.run.validation import validate
from fl.strategy.client import ClientHooks
from fl.wire.records import Layout, numpy_to_array

TORCH = {
    "momentum": functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=1e-3),
    "adam": functools.partial(torch.optim.Adam, betas=(0.8, 0.99), weight_decay=1e-3),
    "adamw": functools.partial(torch.optim.AdamW, betas=(0.8, 0.99), weight_decay=1e-2),
}


def _settings(optimizer: str, seed: int, lr: float = 1e-2) -> TrainSettings:
    decay = {"momentum": 1e-3, "adam": 1e-3, "adamw": 1e-2}[optimizer]
    return TrainSettings(
        7, 0, 8, lr, 0.9, decay, seed, optimizer=optimizer, betas=(0.8, 0.99), eps=1e-8
    )


def _data(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))


def test_the_choices_are_the_configs():
    assert tuple(MOMENTS) == OPTIMIZERS


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "adamw"])
def test_two_rounds_equal_torchs_optimizer_kept_by_hand(optimizer):
    """The trainer's batches (its seeded permutation, a second epoch after 5 batches of 8)
    and torch's optimizer, one object kept across both rounds, run by hand on them:
    identical weights and moments after two rounds, the second from the first's state."""
    from clients.trainer import _batches

    x, y = _data()
    ours, theirs = _model(), _model()
    by_hand = TORCH[optimizer](theirs.parameters(), lr=1e-2)
    memory = OptimizerState.fresh(optimizer, sum(p.numel() for p in ours.parameters()))
    for seed in (11, 12):
        settings = _settings(optimizer, seed)
        train_locally(ours, x, y, ClientHooks(None), settings, memory=memory)
        generator = torch.Generator().manual_seed(seed)
        for batch in _batches(len(y), generator, settings, ClientHooks(None)):
            by_hand.zero_grad()
            F.cross_entropy(theirs(x[batch]), y[batch]).backward()
            by_hand.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    params = list(theirs.parameters())
    assert memory is not None and memory.step == 14
    for name in MOMENTS[optimizer]:
        expected = torch.cat([by_hand.state[p][name].reshape(-1) for p in params])
        assert torch.equal(memory.moments[name], expected), name
        assert bool(expected.abs().sum() > 0)
    if optimizer != "momentum":
        assert int(by_hand.state[params[0]]["step"]) == 14


def test_adams_first_step_moves_every_weight_by_about_lr():
    """Adam's first step from zero moments is lr · g / (|g| + eps): each weight with a
    gradient moves by lr (to 1e-4), whatever the gradient's scale (SGD's would not)."""
    x, y = _data()
    model = nn.Linear(5, 3)  # no ReLU: every weight gets a gradient
    start = [p.detach().clone() for p in model.parameters()]
    settings = replace(_settings("adam", 5, lr=1e-3), local_steps=1, weight_decay=0.0)
    train_locally(model, 100 * x, y, ClientHooks(None), settings)
    pairs = zip(model.parameters(), start, strict=True)
    moved = torch.cat([(p - s).abs().reshape(-1) for p, s in pairs])
    assert torch.allclose(moved, torch.full((18,), 1e-3), rtol=1e-4)


def _cohort_members(optimizer: str, clients: int) -> tuple[nn.Module, Layout, list[Member]]:
    """Digits clients, each with optimizer state from an earlier round of its own."""
    from fl.world.task import get_task

    task = get_task(compose(["partition=dirichlet", f"num_clients={clients}"]))
    model = task.new_model()
    layout = Layout.of(model.state_dict())
    first = layout.read(model)
    members = []
    for k in range(clients):
        x, y = task.client_data(k)
        memory = OptimizerState.fresh(optimizer, layout.numel)
        layout.load_into(model, first + 0.01 * k)
        warmup = replace(_settings(optimizer, 500 + k), local_steps=3 + k, batch_size=16)
        train_locally(model, x, y, ClientHooks(None), warmup, memory=memory)
        start = layout.read(model)
        settings = replace(warmup, seed=1000 + k, local_steps=0, local_epochs=1)
        members.append(Member(start, x, y, ClientHooks(None), settings, memory))
    return model, layout, members


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "adamw"])
def test_a_cohort_keeps_each_members_optimizer_state(optimizer):
    """Members with states of unequal step counts and ragged epochs: the cohort's weights
    and moments stay within its per-step tolerance of each member trained alone."""
    model, layout, members = _cohort_members(optimizer, 5)
    alone = []
    for member in members:
        assert member.memory is not None
        memory = OptimizerState(member.memory.step, dict(member.memory.moments))
        layout.load_into(model, member.start)
        result = train_locally(
            model, member.x, member.y, ClientHooks(None), member.settings, memory=memory
        )
        alone.append((layout.read(model), memory, result.steps))
    trained, results = train_cohort(model, layout, members, torch.device("cpu"))
    for member, row, result, (weights, memory, steps) in zip(
        members, trained, results, alone, strict=True
    ):
        assert result.steps == steps and member.memory is not None
        assert member.memory.step == memory.step
        bound = steps * (STEP_TOLERANCE["atol"] + STEP_TOLERANCE["rtol"] * weights.abs())
        assert bool(((row - weights).abs() <= bound).all())
        assert float((row - member.start).abs().max()) > 1e-4  # it did train
        for name, value in memory.moments.items():
            ours = member.memory.moments[name]
            tolerance = steps * (STEP_TOLERANCE["atol"] + STEP_TOLERANCE["rtol"] * value.abs())
            assert bool(((ours - value).abs() <= tolerance).all()), name


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_a_cohort_run_ends_with_the_per_client_runs_metrics(tmp_path, optimizer):
    common = (
        "rounds=3",
        "progress=false",
        "plots=false",
        f"optimizer={optimizer}",
        "momentum=0.9",
        "lr=0.01",
        "weight_decay=1e-4",
        "num_clients=8",
        "clients_per_round=5",
    )
    alone, _ = train_in_process(tmp_path / "alone", *common)
    cohort = functools.partial(LocalGrid, cohort=True)
    together, grid = train_in_process(tmp_path / "cohort", *common, grid_class=cohort)
    assert grid.cohort_trained >= 2 * len(alone)
    assert states_of(grid) and all(step > 0 for step in states_of(grid))
    for a, b in zip(alone, together, strict=True):
        for key in ("accuracy", "loss"):
            assert b[key] == pytest.approx(a[key], **METRIC_TOLERANCE), key
    assert alone[-1]["accuracy"] > alone[0]["accuracy"]


def states_of(grid: LocalGrid) -> list[int]:
    """The step counts of the optimizer states the grid's nodes keep."""
    from fl.wire.records import array_to_numpy

    return [
        int(array_to_numpy(state.array_records[STATE_KEY]["step"])[0])
        for state in grid.states.values()
        if STATE_KEY in state.array_records
    ]


def test_the_state_survives_a_kill_and_resume(tmp_path):
    """Adam's moments and step counts are in the nodes' state, so in the checkpoint: a run
    killed after round 3 resumes to the uninterrupted run's metrics."""
    run = [
        "num_clients=6",
        "clients_per_round=4",
        "rounds=8",
        "local_epochs=1",
        "optimizer=adam",
        "lr=0.003",
        "plots=false",
    ]
    assert_resumes_identically(tmp_path, run, rounds=8)


def _record(numel: int, **changes: np.ndarray) -> RecordDict:
    arrays = {
        "step": np.array([4], dtype=np.int64),
        "exp_avg": np.zeros(numel, dtype=np.float32),
        "exp_avg_sq": np.ones(numel, dtype=np.float32),
        **changes,
    }
    return RecordDict({STATE_KEY: ArrayRecord({k: numpy_to_array(v) for k, v in arrays.items()})})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"exp_avg_sq": -np.ones(6, dtype=np.float32)}, "exp_avg_sq has negative values"),
        ({"exp_avg": np.full(6, np.nan, dtype=np.float32)}, "exp_avg has non-finite values"),
        ({"exp_avg": np.zeros(5, dtype=np.float32)}, "exp_avg must be 6 float32 values"),
        ({"exp_avg": np.zeros(6, dtype=np.float64)}, "exp_avg must be 6 float32 values"),
        ({"step": np.array([-1], dtype=np.int64)}, "step must be one int64 >= 0"),
        ({"momentum_buffer": np.zeros(6, dtype=np.float32)}, "optimizer=adam keeps"),
    ],
)
def test_a_bad_state_is_refused_in_one_line(changes, message):
    assert OptimizerState.load(_record(6), "adam", 6) is not None  # the good one loads
    with pytest.raises(ValueError, match=message) as info:
        OptimizerState.load(_record(6, **changes), "adam", 6)
    assert str(info.value).startswith(f"node state '{STATE_KEY}' refused: ")
    assert "\n" not in str(info.value)


def test_a_saved_state_loads_back():
    memory = OptimizerState(9, {"momentum_buffer": torch.arange(4.0)})
    state = RecordDict()
    memory.save(state)
    again = OptimizerState.load(state, "momentum", 4)
    assert again is not None and again.step == 9
    assert torch.equal(again.moments["momentum_buffer"], torch.arange(4.0))
    assert OptimizerState.load(state, "sgd", 4) is None  # sgd keeps nothing


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_apf_with_adam_keeps_frozen_scalars_exactly_frozen(optimizer):
    """APF rolls frozen scalars back after every step: Adam's moments (fed by the frozen
    scalars' gradients, and AdamW's decay) never move them, over two rounds of state."""
    from fl.wire.sync import SyncServer
    from strategies.apf import APFHooks, APFParams, synced_state

    model = _model()
    layout = Layout.of(model.state_dict())
    start = layout.flatten(model.state_dict())
    mask = torch.rand(layout.numel, generator=torch.Generator().manual_seed(1)) > 0.5
    sync = SyncServer(synced_state(APFParams()))
    sync.publish(1, {"model": start, "mask": mask})
    records, _ = sync.records(0, layout)
    x, y = _data()
    state = RecordDict()
    memory = OptimizerState.fresh(optimizer, layout.numel)
    for seed in (1, 2):
        content = RecordDict({**records, "config": ConfigRecord({"server-round": seed})})
        hooks = APFHooks(APFParams())
        hooks.load(model, content, state, layout)
        train_locally(model, x, y, hooks, _settings(optimizer, seed, lr=0.05), memory=memory)
        after = layout.flatten(model.state_dict())
        assert torch.equal(after[~mask], start[~mask])
        assert not torch.equal(after[mask], start[mask])
    assert memory is not None and bool((memory.moments["exp_avg"][~mask] != 0).any())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimizer=rmsprop"], "optimizer='rmsprop': must be one of"),
        (["optimizer=momentum"], "momentum=0.0: optimizer=momentum needs > 0"),
        (["optimizer=adam", "betas=[0.9,1.0]"], "betas=[0.9, 1.0]: must be two numbers"),
        (["optimizer=adam", "eps=0"], "eps=0: must be a finite number > 0"),
    ],
)
def test_bad_optimizer_settings_are_refused_before_the_run(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(compose(overrides))
    validate(compose(["optimizer=adamw", "weight_decay=0.01"]))
