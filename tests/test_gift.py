"""GIFT's frequency rule on hand-built update sequences, and the plugin end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import read_metrics, run_fl, without_wall_time

from fl.strategy.server import ClientUpdate
from strategies.gift import FrequencyState, GIFTParams, GIFTServer, tune_frequency


def _updates(base: torch.Tensor, agreement: float) -> list[ClientUpdate]:
    """Two clients whose one-scalar updates 1 and -a have consistency (1 - a) / (1 + a)."""
    return [
        ClientUpdate(1, base + torch.tensor([1.0]), 10, {}),
        ClientUpdate(2, base - torch.tensor([agreement]), 10, {}),
    ]


def _server(params: GIFTParams) -> GIFTServer:
    server = GIFTServer(params, seed=0, clients_per_round=2)
    server.global_vector = torch.zeros(1)
    server.on_round_start(1)
    return server


def test_falling_then_flat_consistency_halves_local_steps_once_at_the_right_round():
    params = GIFTParams(initial_steps=64, ema=0.0, window=5, warmup=0, window_rule="doubling")
    server = _server(params)  # θ = 0: C is raw; the reference code's doubling window
    a_series = [0.0, 0.2, 0.4, 0.6] + [0.6] * 10  # C falls for 4 rounds, then stays flat
    steps = []
    for r, a in enumerate(a_series, start=1):
        server.aggregate(r, _updates(server.global_vector, a))
        assert server.diagnostics()["consistency"] == pytest.approx((1 - a) / (1 + a))
        steps.append(server.train_config(r + 1, 1)["local-steps"])
    # low at round 4; no new low for more than W = 5 rounds first at round 10
    assert steps == [64] * 9 + [32] * 5
    assert server.frequency.changes == [(10, 32)]
    assert int(server.frequency.detector.window[0]) == 10  # W doubled


def test_flat_consistency_walks_down_with_doubling_windows_to_the_floor():
    params = GIFTParams(
        initial_steps=8, min_steps=2, ema=0.5, window=1, warmup=0, window_rule="doubling"
    )
    state = FrequencyState.fresh(3, params)
    for r in range(1, 30):
        tune_frequency(state, 0.5, r, params)
    # stalls at 3 (W=1); low at 4, stall at 7 (W=2); then at τ = 2 = min_steps it stays
    assert state.changes == [(3, 4), (7, 2)]
    assert state.steps == 2


def test_warmup_holds_back_the_first_change():
    params = GIFTParams(initial_steps=16, window=1, warmup=10)
    state = FrequencyState.fresh(1, params)
    for r in range(1, 12):
        tune_frequency(state, 0.5, r, params)
    assert state.changes == [(11, 8)]


@pytest.mark.parametrize("increase", [False, True])
def test_rising_consistency_lengthens_local_steps_only_with_the_proposal_on(increase):
    params = GIFTParams(
        initial_steps=16, window=2, warmup=0, increase=increase, window_rule="doubling"
    )
    state = FrequencyState.fresh(1, params)
    state.steps = 8  # as after an earlier halving
    series = [0.5, 0.4, 0.3, 0.5, 0.5, 0.5]  # low 0.3 at round 3, then 67 % above it
    for r, c in enumerate(series, start=1):
        tune_frequency(state, c, r, params)
    if increase:  # two rounds above (1 + 0.2) × low: back up at round 5, capped at τ_0
        assert state.changes == [(5, 16)]
    else:  # the reference rule only ever shortens: no new low for > 2 rounds at round 6
        assert state.changes == [(6, 4)]


def test_the_default_window_is_fixed_and_both_directions_are_on():
    """Spec §3.3's fixed window (shared with PAS) and the abstract's two directions: a flat C
    halves τ every W rounds; C rising 67 % above its low for W rounds doubles it back."""
    params = GIFTParams(initial_steps=16, min_steps=2, window=2, warmup=0)
    assert params.window_rule == "fixed" and params.increase
    state = FrequencyState.fresh(1, params)
    series = [0.5] * 6 + [0.3] + [0.5] * 3  # flat, a new low at round 7, then 67 % above it
    for r, c in enumerate(series, start=1):
        tune_frequency(state, c, r, params)
    # each window opens on a first value: halved at 2, 4 and 6 (16 → 8 → 4 → 2 = min_steps);
    # 0.3 opens the window after 6, two rounds above (1 + δ) × 0.3 double τ at 9
    assert state.changes == [(2, 8), (4, 4), (6, 2), (9, 4)]
    with pytest.raises(ValueError, match="window_rule"):
        GIFTParams(window_rule="halving").validate()


def test_params_need_local_steps():
    with pytest.raises(ValueError, match="local_steps > 0"):
        GIFTParams(initial_steps=0).validate()


RUN = [
    "strategy=gift",
    "num_clients=6",
    "clients_per_round=4",
    "local_steps=16",
    "strategy.window=1",
    "strategy.warmup=2",
    "strategy.ema=0.5",
]


def test_gift_run_shortens_rounds_and_resumes_to_identical_metrics(tmp_path):
    run_fl(tmp_path / "full", *RUN, "rounds=10", fresh=True)  # own hash seed, unlike forks
    rows = read_metrics(tmp_path / "full")
    steps = [r["local_steps"] for r in rows]
    assert steps[0] == 16 and steps[-1] < 16
    assert steps == sorted(steps, reverse=True)  # the reference rule only shortens
    assert all(0 < r["consistency"] <= 1 for r in rows)
    assert rows[-1]["round_time_s"] < rows[0]["round_time_s"]  # fewer steps, shorter rounds
    assert rows[-1]["accuracy"] > 0.5

    run_fl(tmp_path / "resumed", *RUN, "rounds=5")
    run_fl(tmp_path / "resumed", *RUN, "rounds=10", "resume=true")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(rows)
