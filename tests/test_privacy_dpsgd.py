"""DP-SGD through Opacus: real clipping and noise, Poisson batches, ε that matches Opacus, runs."""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    REPO,
    fl_env,
    fl_run_cmd,
    python_popen,
    read_metrics,
    run_fl,
    without_wall_time,
)
from flwr.app import ConfigRecord, RecordDict
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from torch import nn

from clients.trainer import TrainSettings, train_locally
from fl.common.config import ConfigError, compose
from fl.run.validation import validate
from fl.strategy.client import ClientHooks
from fl.world.task import get_task
from privacy.dpsgd import DPSGD, Plan, PrivateTraining, account, epsilon_of, history_of

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")


def _dp(**overrides: object) -> DPSGD:
    values: dict[str, object] = {
        "noise_multiplier": 0.0,
        "max_grad_norm": 0.05,
        "delta": 1e-5,
        "target_epsilon": None,
        "accountant": "rdp",
        "sampling": "poisson",
        "rounds": 1,
        "batch_size": 8,
        "local_steps": 1,
        "local_epochs": 1,
    }
    values.update(overrides)
    return DPSGD(**values)  # type: ignore[arg-type]


def _data(n: int = 40) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(6, 3), torch.randn(n, 6) * 3, torch.randint(0, 3, (n,))


def _one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dp: DPSGD) -> torch.Tensor:
    """Parameter change of one private local step (lr 1)."""
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    plan = dp.plan(len(y))
    settings = TrainSettings(local_steps=1, local_epochs=1, batch_size=8, lr=1.0, seed=3)
    train_locally(model, x, y, ClientHooks(None), settings, PrivateTraining(dp, plan, seed=11))
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def _clipped_mean(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dp: DPSGD) -> torch.Tensor:
    """What DP-SGD's step must be without noise: Σ clip(g_i) / E[B] over the Poisson batch."""
    plan = dp.plan(len(y))
    generator = torch.Generator().manual_seed(3)  # the trainer's batch generator
    batch = (torch.rand(len(y), generator=generator) < plan.sample_rate).nonzero().squeeze(1)
    total = torch.zeros(sum(p.numel() for p in model.parameters()))
    for i in batch.tolist():
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        total += grad * min(1.0, dp.max_grad_norm / (float(grad.norm()) + 1e-6))
    return -total / plan.expected_batch_size


def test_each_example_is_clipped_to_max_grad_norm():
    model, x, y = _data()
    dp = _dp()
    expected = _clipped_mean(model, x, y, dp)
    step = _one_step(model, x, y, dp)
    assert torch.allclose(step, expected, atol=1e-6)
    assert float(step.norm()) < 0.05 * len(y) / dp.plan(len(y)).expected_batch_size
    assert not hasattr(next(model.parameters()), "grad_sample")  # hooks removed afterwards


def test_noise_has_standard_deviation_sigma_times_clip_norm():
    model, x, y = _data()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    clean = _one_step(model, x, y, _dp())
    model.load_state_dict(state)
    dp = _dp(noise_multiplier=2.0, max_grad_norm=0.5)
    noisy = _one_step(model, x, y, dp)
    model.load_state_dict(state)
    clean_at_c = _one_step(model, x, y, _dp(max_grad_norm=0.5))
    noise = (noisy - clean_at_c) * dp.plan(len(y)).expected_batch_size
    assert float(noise.std()) == pytest.approx(2.0 * 0.5, rel=0.25)  # 21 parameters
    model.load_state_dict(state)
    assert torch.equal(_one_step(model, x, y, dp), noisy)  # seeded noise: reproducible runs
    assert not torch.equal(clean, noisy)


def test_poisson_batches_have_binomial_sizes():
    plan = Plan(noise_multiplier=1.0, sample_rate=0.25, steps=4000, expected_batch_size=10.0)
    sizes = torch.tensor(
        [len(b) for b in PrivateTraining(_dp(), plan, 0).batches(40, torch.Generator())],
        dtype=torch.float64,
    )
    assert len(sizes) == 4000
    assert float(sizes.mean()) == pytest.approx(10.0, abs=0.2)  # n q
    assert float(sizes.var()) == pytest.approx(7.5, rel=0.1)  # n q (1 - q): not fixed-size
    assert PrivateTraining(_dp(sampling="shuffle"), plan, 0).batches(40, torch.Generator()) is None


def test_strategy_gradient_hook_sees_the_privatised_gradient():
    class Freeze(ClientHooks):
        def before_step(self, model: nn.Module) -> None:
            for p in model.parameters():
                p.grad.zero_()

    model, x, y = _data()
    before = [p.detach().clone() for p in model.parameters()]
    settings = TrainSettings(local_steps=3, local_epochs=1, batch_size=8, lr=1.0, seed=3)
    dp = _dp(noise_multiplier=1.0, local_steps=3)
    train_locally(model, x, y, Freeze(None), settings, PrivateTraining(dp, dp.plan(40), 0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_accountant_history_lives_in_node_state_and_matches_opacus():
    dp = _dp(noise_multiplier=1.1)
    plan = dp.plan(40)  # q = 1/5, 1 step per round
    state = RecordDict()
    for _ in range(3):
        epsilon = account(state, plan, 7, dp)
    assert history_of(state) == [(1.1, 0.2, 21)]  # merged, as Opacus's accountant does
    assert isinstance(state.config_records["dpsgd-accountant"], ConfigRecord)
    opacus = RDPAccountant()
    for _ in range(21):
        opacus.step(noise_multiplier=1.1, sample_rate=0.2)
    assert epsilon == opacus.get_epsilon(delta=1e-5)
    other = Plan(0.8, 0.5, 2, 20.0)
    mixed = account(state, other, 4, dp)
    assert history_of(state) == [(1.1, 0.2, 21), (0.8, 0.5, 4)]
    for _ in range(4):
        opacus.step(noise_multiplier=0.8, sample_rate=0.5)
    assert mixed == pytest.approx(opacus.get_epsilon(delta=1e-5), rel=1e-12)
    assert epsilon_of([], dp) == 0.0


# ----- fl-run end to end -------------------------------------------------------------------

RUN = [
    "privacy=dpsgd",
    "num_clients=5",
    "clients_per_round=5",
    "rounds=6",
    "local_epochs=1",
    "batch_size=16",
    "lr=0.5",
]


def _opacus_plans(target: float, rounds: int) -> dict[int, tuple[float, float, int]]:
    """Per client: (σ for ε = `target` after `rounds`, sample rate, steps per round)."""
    task = get_task(compose(RUN))
    plans = {}
    for p, part in enumerate(task.partitions):
        per_epoch = math.ceil(len(part) / 16)  # Opacus DPDataLoader: q = 1 / batches per epoch
        sigma = get_noise_multiplier(
            target_epsilon=target,
            target_delta=1e-5,
            sample_rate=1 / per_epoch,
            steps=per_epoch * rounds,
        )
        plans[p] = (sigma, 1 / per_epoch, per_epoch)
    return plans


def _opacus_epsilon(sigma: float, rate: float, steps: int) -> float:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=rate)
    return accountant.get_epsilon(delta=1e-5)


def test_reported_epsilon_is_opacus_epsilon_and_dp_degrades_gracefully(tmp_path):
    runs = [  # two real runs at once (2 cores)
        python_popen(
            fl_run_cmd(f"hydra.run.dir={tmp_path / name}", *RUN, f"privacy.target_epsilon={eps}"),
            capture=False,
        )
        for name, eps in (("loose", 8), ("tight", 1))
    ]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
    rows = read_metrics(tmp_path / "loose")
    summary = json.loads((tmp_path / "loose" / "summary.json").read_text())
    final = {int(p): e for p, e in summary["epsilon_per_client"].items()}
    plans = _opacus_plans(8.0, 6)
    for r in rows:  # every client trains every round, so each row is over all five
        expected = [_opacus_epsilon(sigma, q, k * r["round"]) for sigma, q, k in plans.values()]
        assert r["epsilon_max"] == pytest.approx(max(expected), rel=1e-9)
        assert r["epsilon_mean"] == pytest.approx(sum(expected) / 5, rel=1e-9)
    assert final == pytest.approx(dict(enumerate(expected)), rel=1e-9)
    assert max(final.values()) <= 8.0 and summary["epsilon_max"] == max(final.values())
    loose = rows[-1]["accuracy"]
    tight = read_metrics(tmp_path / "tight")[-1]["accuracy"]
    assert loose > 0.6  # 10 classes: chance is 0.1
    assert 0.1 < tight < loose  # a tighter budget costs accuracy, without collapsing to chance


def test_a_model_opacus_cannot_train_is_refused_by_config_validation_naming_the_layer():
    # fl-run and the ServerApp validate before any round (tests/test_run.py checks that path)
    message = (
        "invalid config: task.model='resnet18': Opacus cannot train layer 'bn1' (BatchNorm2d): "
        "BatchNorm cannot support training with differential privacy"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose(["privacy=dpsgd", "task.model=resnet18"]))
    validate(compose(["privacy=dpsgd", "task=digits", "task.model=cnn"]))  # conv + pool: fine


@pytest.mark.slow
def test_epsilon_survives_resume_exactly(tmp_path):
    run = [*RUN[:3], "clients_per_round=3", "local_epochs=1", "privacy.noise_multiplier=1.2"]
    run_fl(tmp_path / "full", *run, "rounds=4")
    run_fl(tmp_path / "split", *run, "rounds=2")
    run_fl(tmp_path / "split", *run, "rounds=4", "resume=true")
    full, split = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "split")
    assert without_wall_time(split) == without_wall_time(full)
    a = json.loads((tmp_path / "full" / "summary.json").read_text())["epsilon_per_client"]
    b = json.loads((tmp_path / "split" / "summary.json").read_text())["epsilon_per_client"]
    assert a == b and len(a) == 5


@pytest.mark.slow
@pytest.mark.integration
def test_epsilon_accumulates_the_same_on_flower_simulation(tmp_path):
    from netns import in_netns, require_netns

    require_netns()  # Ray probes 8.8.8.8 on start: keep it in a loopback-only namespace
    run = [*RUN[:2], "num_clients=4", "clients_per_round=2", "rounds=3", "local_epochs=1"]
    sim = subprocess.run(
        in_netns(fl_run_cmd(f"hydra.run.dir={tmp_path / 'sim'}", "engine=flower-sim", *run)),
        cwd=REPO,
        env=fl_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sim.returncode == 0, sim.stdout[-3000:] + sim.stderr[-3000:]
    run_fl(tmp_path / "local", *run)
    a = json.loads((tmp_path / "sim" / "summary.json").read_text())["epsilon_per_client"]
    b = json.loads((tmp_path / "local" / "summary.json").read_text())["epsilon_per_client"]
    assert a == b and len(a) == 4  # node state (the accountant) persists across Ray calls
    rows = read_metrics(tmp_path / "sim")
    assert [r["epsilon_max"] for r in rows] == [
        r["epsilon_max"] for r in read_metrics(tmp_path / "local")
    ]
