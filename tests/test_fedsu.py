"""FedSU: the speculation mechanics (fl.mechanisms.speculation) and the plugin end to end."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import read_metrics, run_fl, without_wall_time
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from torch import nn

from fl.mechanisms.diagnosis import LinearityTest
from fl.mechanisms.speculation import (
    ErrorFeedback,
    Speculation,
    checks_due,
    digest,
    error_ratio,
    phase_error,
)
from fl.wire.codec import encode_dense, payload_traffic
from fl.wire.records import Layout
from strategies.fedsu import (
    FedSUHooks,
    FedSUParams,
    FedSUServer,
    FedSUState,
    control_step,
    reply_mask,
)


def _rates(updates: torch.Tensor, theta: float = 0.99) -> torch.Tensor:
    """R after folding in the rows of `updates` (rounds, scalars)."""
    test = LinearityTest.fresh(updates.shape[1], theta)
    everywhere = torch.ones(updates.shape[1], dtype=torch.bool)
    rate = torch.ones(updates.shape[1])
    for update in updates:
        rate = test.update(update, everywhere)
    return rate


def test_linearity_accepts_a_noisy_line_and_rejects_a_random_walk_of_the_slope():
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(500, 1000, generator=gen)
    line = _rates(0.5 + 0.1 * noise)  # g_k = s + white noise: g' telescopes in the EMA
    walk = _rates(0.5 + 0.1 * noise.cumsum(0))  # the slope itself wanders
    # spec §5.2: with θ = 0.99 about 3/4 of checks on a linear scalar pass T_R = 0.01
    assert (line < 0.01).float().mean().item() == pytest.approx(0.74, abs=0.06)
    assert (walk < 0.01).float().mean().item() < 0.15
    exact = _rates(torch.full((3, 2), 0.25))  # identical updates: g' = 0, R = 0
    assert exact.tolist() == [0.0, 0.0]
    assert _rates(torch.ones(1, 2)).tolist() == [1.0, 1.0]  # one update: unknown


def test_speculated_values_follow_the_closed_form_and_checks_fall_on_triangular_ticks():
    spec = Speculation.fresh(torch.tensor([1.0, 2.0]))
    spec.start(torch.tensor([True, False]), torch.tensor([3.0, 9.0]), torch.tensor([0.5, 7.0]), 3)
    assert spec.values(3).tolist() == [3.0, 2.0]
    assert spec.values(7).tolist() == [5.0, 2.0]  # 3 + 4 * 0.5; regular: its anchor
    due = [t for t in range(3, 20) if bool(checks_due(spec, t)[0])]
    assert due == [3, 5, 8, 12, 17]  # periods 1, 2, 3, 4, 5 ticks
    assert not bool(checks_due(spec, 5)[1])
    assert error_ratio(torch.tensor([0.5, 0.0, 1e-9]), torch.tensor([1.0, 0.0, 0.0])).tolist() == [
        0.5,
        0.0,
        float("inf"),
    ]


def _simulate(params: FedSUParams, slopes: list[float], noise: float = 0.0):
    """One scalar trained by two clients whose round update is `slopes[k]` (+ noise);
    returns per round (speculating?, global value, counts)."""
    gen = torch.Generator().manual_seed(1)
    state = FedSUState(Speculation.fresh(torch.zeros(1)), LinearityTest.fresh(1, 0.5), 0)
    client_states = [RecordDict(), RecordDict()]
    history = []
    for slope in slopes:
        spec, tick = state.speculation, state.clock
        base, predicted = spec.values(tick), spec.values(tick + 1)
        due = reply_mask(spec, tick, params) & spec.speculating
        means, locals_ = [], []
        for client in client_states:
            local = base + slope + noise * torch.randn(1, generator=gen)
            feedback = ErrorFeedback.load(client, spec, tick, params.error_reset)
            feedback.add(spec.speculating, local - predicted)
            feedback.save(client)
            means.append(feedback.mean())
            locals_.append(local)
        error = phase_error(torch.stack(means), torch.ones(2), spec, tick, params.error_reset)
        error = torch.where(due, error, torch.zeros_like(error))
        vector = torch.stack(locals_).mean(0)
        nxt, counts = control_step(state, vector, error, params, gen)
        history.append((bool(state.speculation.speculating[0]), float(nxt[0]), counts))
    return history


def test_error_feedback_keeps_a_straight_line_and_resyncs_when_the_slope_changes():
    params = FedSUParams(linearity_threshold=0.01, error_threshold=1.0)
    history = _simulate(params, [1.0] * 12 + [3.0] * 10)
    speculating = [h[0] for h in history]
    assert speculating[:2] == [False, True]  # two equal updates: R = 0, speculated
    assert all(speculating[1:12])  # errors stay 0: every check passes
    assert [h[1] for h in history[:12]] == [float(k + 1) for k in range(12)]  # x moves by s
    left = next(k for k in range(12, 22) if not speculating[k])
    # the first check after the change (ticks 1, 3, 6, 10, 15 after the start at 2)
    # sees 2 per round of error against a slope of 1: S >= 1, back to regular sync
    assert left == 16 and history[left][2]["left"] == 1
    # regular again: the global value is the clients' average, the line's error is gone
    resynced = history[left + 1][1] - history[left][1]
    assert resynced == pytest.approx(3.0)
    # exit_correction adds the known error ē: 2 per round over the 5 rounds since the change
    corrected = _simulate(replace(params, exit_correction=True), [1.0] * 12 + [3.0] * 10)
    assert corrected[left][1] - history[left][1] == pytest.approx(2.0 * 5)


def test_the_warmup_gate_holds_speculation_until_r_has_enough_samples():
    params = FedSUParams(linearity_threshold=0.01, error_threshold=1.0)
    # by default R is trusted from its first second difference (round 2: R = 0 on a line)
    assert [h[0] for h in _simulate(params, [1.0] * 8)][:3] == [False, True, True]
    gated = _simulate(replace(params, warmup_rounds=4), [1.0] * 8)
    # the 4th second difference is folded in at round 5: speculation starts there
    assert [h[0] for h in gated] == [False] * 4 + [True] * 4
    with pytest.raises(ValueError, match="warmup_rounds"):
        FedSUParams(warmup_rounds=-1).validate()


def test_error_reset_judges_each_window_instead_of_the_whole_phase():
    # the slope is taken as 1, training moves the scalar by 1.15 a round: 0.15 of error a
    # round against the fixed slope
    slopes = [1.0, 1.0] + [1.15] * 30
    params = FedSUParams(linearity_threshold=0.01, error_threshold=1.0)
    whole = [h[0] for h in _simulate(params, slopes)]
    # accumulated over the phase (checks after 1, 3, 6, 10 rounds): 1.5 slopes at the
    # 4th check, at tick 11 (the phase started at tick 2), so it leaves there
    assert whole[1:11] == [True] * 10 and not whole[11]
    reset = [h[0] for h in _simulate(replace(params, error_reset=True), slopes)]
    # from the last passed check: windows of 1, 2, 3, ... rounds hold 0.15 × their length,
    # below one slope until the 7th window (1.05 slopes, 28 rounds in, at tick 29)
    assert reset[1:29] == [True] * 28 and not reset[29]


def test_without_error_feedback_v1_speculates_for_a_fixed_period_whatever_the_error():
    params = FedSUParams(variant="fedsu_v1", fixed_period=5)
    history = _simulate(params, [1.0] * 3 + [-4.0] * 6)
    assert [h[0] for h in history] == [False, True, True, True, True, True, False, False, False]
    assert all(h[2]["checked"] == 0 for h in history)
    # the mis-prediction went unnoticed: the scalar kept moving up by 1 while training
    # pulled it down by 4 per round
    assert history[5][1] == 6.0


def test_v2_speculates_at_random_reproducibly_whatever_the_linearity():
    params = FedSUParams(variant="fedsu_v2", random_probability=0.1)
    picks = []
    for seed in (3, 3, 4):
        state = FedSUState(Speculation.fresh(torch.zeros(5000)), LinearityTest.fresh(5000, 0.99), 0)
        gen = torch.Generator().manual_seed(seed)
        walk = torch.randn(5000, generator=torch.Generator().manual_seed(0))  # not linear
        control_step(state, walk, torch.zeros(5000), params, gen)
        picks.append(state.speculation.speculating.clone())
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])
    assert picks[0].float().mean().item() == pytest.approx(0.1, abs=0.015)


def _message(server: FedSUServer, node: int, tick: int) -> RecordDict:
    config = ConfigRecord({"server-round": tick + 1, **server.train_config(tick + 1, node)})
    return RecordDict({**server.train_payload(tick + 1, node), "config": config})


def test_speculated_values_are_bit_identical_on_every_client_including_returning_ones():
    """Five nodes, two or three per round; each message rebuilds the server's model exactly,
    whatever rounds a node skipped, and costs less than the dense model once speculating."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.Linear(30, 4))
    layout = Layout.of(model.state_dict())
    server = FedSUServer(FedSUParams(ema=0.5, linearity_threshold=0.3), seed=0, clients_per_round=3)
    server.layout, server.global_vector = layout, layout.flatten(model.state_dict())
    drift = 0.01 * torch.randn(layout.numel)
    states = {node: RecordDict() for node in range(5)}
    gen = torch.Generator().manual_seed(2)
    dense = 4 * layout.numel
    cheaper = 0
    for rnd in range(1, 16):
        server._dense_payload = encode_dense(server.global_vector, layout)
        server.on_round_start(rnd)
        server.sync.publish(rnd, server.synced())
        tick = server.control.clock
        chosen = torch.randperm(5, generator=gen)[: 2 + rnd % 2].tolist()
        for node in chosen:
            hooks = FedSUHooks(server.params)
            content = _message(server, node, tick)
            hooks.load(model, content, states[node], layout)
            assert torch.equal(hooks.base, server.global_vector)  # bits, not closeness
            assert torch.equal(layout.flatten(model.state_dict()), server.global_vector)
            assert digest(hooks.base) == digest(server.global_vector)
            cheaper += payload_traffic(content).payload < dense
            server.sync.confirm(node, rnd)
        step = drift * (1 + 0.3 * torch.rand(layout.numel, generator=gen))
        aggregated = server.global_vector + step
        server.global_vector, _ = control_step(
            server.control, aggregated, torch.zeros(layout.numel), server.params, gen
        )
    assert server.control.speculation.speculating.float().mean().item() > 0.3
    assert cheaper > 10
    # a reply trained from any other model (one flipped bit) is rejected: the node resyncs
    hooks.base = hooks.base.clone()
    hooks.base.view(torch.int32)[0] ^= 1
    records, metrics = hooks.end(model, RecordDict(), layout)
    reply = SimpleNamespace(content=RecordDict({**records, "metrics": MetricRecord(metrics)}))
    with pytest.raises(ValueError, match="other than the one sent"):
        server.decode_reply(reply, server.global_vector)


def test_the_config_file_states_the_dataclass_defaults():
    values = yaml.safe_load((Path(__file__).parents[1] / "conf/strategy/fedsu.yaml").read_text())
    assert values.pop("name") == "fedsu"
    assert values == dataclasses.asdict(FedSUParams())


RUN = [
    "strategy=fedsu",
    "strategy.ema=0.5",
    "strategy.linearity_threshold=0.3",
    "num_clients=6",
    "clients_per_round=4",
    "local_steps=5",
]


@pytest.mark.slow  # an end-to-end run with resume (~20 s); the mechanics have fast tests
def test_fedsu_run_speculates_consistently_saves_bytes_and_resumes(tmp_path):
    run_fl(tmp_path / "full", *RUN, "rounds=8", fresh=True)
    rows = read_metrics(tmp_path / "full")
    # every reply's digest matched the server's model: no client, including those that
    # skipped rounds, trained from other speculated values
    assert all(r["rejected"] == 0 and r["failed"] == 0 for r in rows)
    assert rows[0]["speculated_fraction"] == 0.0 and rows[-1]["speculated_fraction"] > 0.2
    dense = rows[0]["payload_bytes_up"]  # round 1: every scalar from 4 clients
    # speculation starts after round 2; round 3 still uploads the errors of the scalars
    # it checks after one round; from then on uploads (and traffic) stay below FedAvg's
    later = rows[3:]
    assert all(r["payload_bytes_up"] < dense for r in later)
    assert sum(r["bytes_up"] + r["bytes_down"] for r in later) < 2 * dense * len(later)
    assert any(r["speculation_checked"] > 0 for r in rows)
    assert rows[-1]["accuracy"] > 0.5

    run_fl(tmp_path / "resumed", *RUN, "rounds=4")
    run_fl(tmp_path / "resumed", *RUN, "rounds=8", "resume=true")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(rows)
