"""2D-LRD (a proposal): both signals and the lr schedule on hand-made updates, the client
hook inside the real trainer, the ablation axes, and the plugin end to end with resume."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import read_metrics, run_fl, without_wall_time
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from clients.trainer import TrainSettings, train_locally
from fl.strategy.server import ClientUpdate
from fl.wire.records import Layout
from strategies.lrd2d import (
    DecaySchedule,
    LRDHooks,
    LRDParams,
    LRDServer,
    client_agreement,
    update_correlation,
)


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_signals_match_their_definitions_on_hand_made_updates():
    a, b = [3.0, 4.0, 0.0], [-4.0, 3.0, 5.0]
    assert update_correlation(torch.tensor(a), torch.tensor(b)) == pytest.approx(_cos(a, b))
    assert update_correlation(
        torch.tensor([1.0, -2.0]), torch.tensor([-2.0, 4.0])
    ) == pytest.approx(-1.0)
    assert update_correlation(torch.tensor([1.0, 2.0]), torch.zeros(2)) == 0.0

    g = [[1.0, 2.0, 0.0], [2.0, -1.0, 1.0], [-1.0, 0.5, 3.0], [0.0, 0.0, 0.0]]
    pairs = list(itertools.combinations(g, 2))
    dots = sum(sum(x * y for x, y in zip(p, q, strict=True)) for p, q in pairs)
    norms = sum(math.dist(p, [0] * 3) * math.dist(q, [0] * 3) for p, q in pairs)
    assert client_agreement(torch.tensor(g)) == pytest.approx(dots / norms, rel=1e-12)
    assert client_agreement(torch.tensor([[1.0, 1.0], [2.0, 2.0]])) == pytest.approx(1.0)
    assert client_agreement(torch.tensor([[1.0, 0.0], [-3.0, 0.0]])) == pytest.approx(-1.0)
    assert client_agreement(torch.tensor([[1.0, 0.0]])) == 1.0  # no pair: nothing disagrees


def _round(server: LRDServer, r: int, client_steps: list[list[float]]) -> None:
    """One aggregation of equally weighted clients whose steps are `client_steps`."""
    server.on_round_start(r)
    base = server.global_vector
    updates = [ClientUpdate(i, base + torch.tensor(s), 10, {}) for i, s in enumerate(client_steps)]
    server.global_vector = server.aggregate(r, updates)


# Global steps (mean of the two clients) +1, +1, -1, +1, -1, +1, -1: oscillation from round 3.
# Client steps (1 ± 1) · direction: the two clients are orthogonal, agreement D = 0.
DIRECTIONS = [1, 1, -1, 1, -1, 1, -1]


def _clients(direction: int) -> list[list[float]]:
    return [[2.0 * direction, 0.0], [0.0, 2.0 * direction]]


@pytest.mark.parametrize("axes", ["both", "round", "inround", "none"])
def test_schedule_follows_the_formulas_and_axes_switch_the_right_factor_off(axes):
    params = LRDParams(
        axes=axes,
        round_rule="halving_cosine",
        round_decay=0.5,
        round_ema=0.5,
        round_window=1,
        step_decay=0.9,
    )
    server = LRDServer(params, seed=0, clients_per_round=2)
    server.global_vector = torch.zeros(2)
    sent, ema, factor, last_decay = [], 0.0, 1.0, 0
    expected = []
    for r, d in enumerate(DIRECTIONS, start=1):
        _round(server, r, _clients(d))
        sent.append(server.sent)
        expected.append((factor, 1.0 if r == 1 or axes in ("round", "none") else 0.9))
        assert server.agreement == pytest.approx(0.0)
        if r > 1:  # S = cos of consecutive global steps: +1 or -1
            s = float(d * DIRECTIONS[r - 2])
            assert server.correlation == pytest.approx(s)
            ema = 0.5 * ema + 0.5 * s
            if axes in ("both", "round") and ema < 0 and r - last_decay > 1:
                factor, last_decay = 0.5 * factor, r
        assert server.schedule.correlation_ema == pytest.approx(ema)
    # S = 1, then -1 every round: EMA 0.5, -0.25, -0.625, ...; a decays at 3, 5, 7 (W = 1)
    assert sent == expected  # exact: powers of 0.5, and 0.9 ** (1 - 0)
    decays = [(3, 0.5), (5, 0.25), (7, 0.125)] if axes in ("both", "round") else []
    assert server.schedule.decays == decays
    server.on_round_start(8)
    assert server.train_config(8, 1) == {
        "lrd-round-factor": 0.125 if decays else 1.0,
        "lrd-step-decay": 0.9 if axes in ("both", "inround") else 1.0,
    }


def test_halving_ablation_waits_for_its_window_and_stops_at_its_floor():
    params = LRDParams(
        round_rule="halving_cosine", round_decay=0.5, round_window=3, min_round_factor=0.3
    )
    schedule = DecaySchedule()
    for r in range(1, 16):  # a reversal every round: the EMA is negative from round 2 on
        schedule.advance(torch.tensor([(-1.0) ** r]), 0.5, r, params)
    assert schedule.decays == [(4, 0.5), (8, 0.3)]  # at the floor: no further "decay"
    assert schedule.step_decay == pytest.approx(0.97**0.5)  # D = 0.5: half the log-decay


def test_round_factor_follows_the_inner_product_sum_and_never_falls_below_its_floor():
    """Default rule: a decays by γ_R when the sum of the last W inner products of
    consecutive global updates (since the last decay) is negative, never below a_min."""
    params = LRDParams(round_decay=0.8, round_window=3, min_round_factor=0.5)
    assert params.round_rule == "inner_product_sum"
    # global updates (1-D): steps shrink while they keep direction, reverse once or twice
    # while the window's sum stays >= 0, then zig-zag
    steps = [4.0, 2.0, 1.0, 1.0, -0.5, 1.0, -4.0, 0.5, -0.5, 0.5, -4.0]
    steps += [4.0, -4.0, 4.0, -4.0, 4.0, -4.0, 4.0, -4.0, 4.0]
    schedule = DecaySchedule()
    window: list[float] = []
    factor, factors, sums = 1.0, [], []
    for r, step in enumerate(steps, start=1):
        product, _ = schedule.advance(torch.tensor([step]), 1.0, r, params)
        if r > 1:
            assert product == steps[r - 2] * step
            window = [*window, product][-3:]
            if len(window) == 3 and sum(window) < 0 and factor > 0.5:
                factor, window = max(0.5, 0.8 * factor), []
        assert schedule.product_sum == pytest.approx(sum(window))
        assert schedule.round_factor == pytest.approx(factor)
        factors.append(schedule.round_factor)
        sums.append(schedule.product_sum)
    # p from round 2: 8, 2, 1, -0.5, -0.5, -4, -2, -0.25, -0.25, -2, -16, ...: negative
    # products at rounds 5 and 6 leave the sum at 2.5 and 0 (no decay); it turns negative
    # at round 7, then every 3 rounds; the 4th decay is clipped to the floor, which holds
    assert [r for r, _ in schedule.decays] == [7, 10, 13, 16]
    assert [a for _, a in schedule.decays] == pytest.approx([0.8, 0.64, 0.512, 0.5])
    assert sums[4:6] == pytest.approx([2.5, 0.0])
    assert min(factors) == 0.5 and factors[-5:] == [0.5] * 5
    # a sum that stays positive (steps that keep their direction) never decays a
    steady = DecaySchedule()
    for r in range(1, 30):
        steady.advance(torch.tensor([1.0 / r, -0.5 / r]), 1.0, r, params)
    assert steady.decays == [] and steady.round_factor == 1.0 and steady.product_sum > 0


def test_round_factor_floor_holds_over_a_long_oscillation():
    params = LRDParams()  # defaults: γ_R 0.9, W 5, a_min 0.1
    schedule = DecaySchedule()
    for r in range(1, 400):
        schedule.advance(torch.tensor([(-1.0) ** r, 0.5]), 1.0, r, params)
    rounds = [r for r, _ in schedule.decays]
    assert rounds[:3] == [6, 11, 16]  # every W rounds once the window is full and negative
    assert schedule.round_factor == pytest.approx(0.1) and min(a for _, a in schedule.decays) >= 0.1
    assert len(rounds) == 22  # 0.9^21 > 0.1 > 0.9^22: the 22nd decay lands on the floor


def test_agreement_maps_to_the_step_decay():
    schedule = DecaySchedule()
    for agreement, decay in [(1.0, 1.0), (0.25, 0.8**0.75), (0.0, 0.8), (-0.6, 0.8)]:
        schedule.advance(torch.ones(1), agreement, 1, LRDParams(step_decay=0.8))
        assert schedule.step_decay == pytest.approx(decay)


def test_trainer_uses_the_hooks_schedule_at_every_step(monkeypatch):
    applied: list[float] = []
    step = torch.optim.SGD.step

    def spy(self, *args, **kwargs):
        applied.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", spy)
    hooks = LRDHooks(LRDParams())
    config = ConfigRecord({"lrd-round-factor": 0.25, "lrd-step-decay": 0.9})
    model = nn.Linear(3, 2)
    hooks.begin(model, config, RecordDict())
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    settings = TrainSettings(local_steps=6, local_epochs=1, batch_size=4, lr=0.4)
    assert train_locally(model, x, y, hooks, settings).steps == 6
    assert applied == pytest.approx([0.4 * 0.25 * 0.9**k for k in range(6)], rel=1e-15)
    _, metrics = hooks.end(model, RecordDict(), Layout.of(model.state_dict()))
    assert metrics["lrd-last-lr"] == applied[-1]

    plain = LRDHooks(LRDParams())  # a stock server sends no factors: the run's lr throughout
    plain.begin(model, ConfigRecord({}), RecordDict())
    assert [plain.lr(k, 0.4) for k in range(3)] == [0.4, 0.4, 0.4]


TINY = [
    "num_clients=6",
    "clients_per_round=4",
    "local_steps=8",
    "lr=3.0",  # large enough for global steps to reverse within a few rounds
]
RUN = ["strategy=lrd2d", "strategy.round_window=1", *TINY]


@pytest.mark.slow  # an end-to-end run with resume (~20 s); the mechanics have fast tests
def test_lrd2d_run_logs_the_schedule_it_applied_and_resumes_to_identical_metrics(tmp_path):
    run_fl(tmp_path / "full", *RUN, "rounds=6", fresh=True)
    rows = read_metrics(tmp_path / "full")
    assert all(r["rejected"] == 0 and r["failed"] == 0 for r in rows)
    window: list[float] = []
    factor, decay = 1.0, 1.0
    for r, row in enumerate(rows, start=1):  # recompute the factors from the logged signals
        assert (row["lr_round_factor"], row["lr_step_decay"]) == pytest.approx(
            (factor, decay), rel=1e-12
        )
        assert row["client_last_lr"] == pytest.approx(3.0 * factor * decay**7, rel=1e-6)
        if r > 1:
            window = [*window, row["update_inner_product"]][-1:]
            if sum(window) < 0 and factor > 0.1:
                factor, window = max(0.1, 0.9 * factor), []
            assert row["inner_product_sum"] == pytest.approx(sum(window))
        decay = 0.97 ** (1 - min(max(row["client_agreement"], 0.0), 1.0))
    assert rows[-1]["lr_round_factor"] < 1.0  # the round axis acted
    assert all(r["lr_step_decay"] < 1.0 for r in rows[1:])  # clients disagree on digits

    run_fl(tmp_path / "resumed", *RUN, "rounds=3")
    run_fl(tmp_path / "resumed", *RUN, "rounds=6", "resume=true")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(rows)


def test_no_axes_is_fedavg(tmp_path):
    run_fl(tmp_path / "fedavg", "strategy=fedavg", *TINY, "rounds=3")
    run_fl(tmp_path / "none", "strategy=lrd2d", "strategy.axes=none", *TINY, "rounds=3")
    fedavg = without_wall_time(read_metrics(tmp_path / "fedavg"))
    none = read_metrics(tmp_path / "none")
    assert [{k: row[k] for k in ref} for row, ref in zip(none, fedavg, strict=True)] == fedavg
    assert len(fedavg) == 3 and none[-1]["lr_step_decay"] == 1.0
