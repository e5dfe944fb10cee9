"""PAS mechanics on hand-built cases (periods, roll-back, groups, bytes, clock), end to end."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import read_metrics, run_fl, without_wall_time
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from clients.trainer import TrainSettings, train_locally
from fl.wire.codec import CodecError, decode, encode_dense, encode_grouped, payload_traffic
from fl.wire.records import Layout
from fl.wire.sync import SyncServer
from fl.world.clock import DeviceProfile, Job, VirtualClock
from strategies.pas import (
    PASHooks,
    PASParams,
    PASServer,
    PeriodState,
    group_sizes,
    shorten,
    synced_state,
    tune_periods,
)


def test_period_ladders_of_the_paper_and_of_the_scaled_preset():
    for params, ladder in [
        (PASParams(initial_period=200), [200, 100, 50, 25, 12, 12]),
        (PASParams(initial_period=64), [64, 32, 16, 8, 4, 4]),
        (PASParams(initial_period=64, ratio=4.0, levels=2), [64, 16, 4, 4]),
    ]:
        periods = torch.tensor([params.initial_period])
        seen = [int(periods[0])]
        for _ in range(len(ladder) - 1):
            shorten(periods, torch.tensor([True]), params)
            seen.append(int(periods[0]))
        assert seen == ladder and params.min_period == ladder[-1]


def test_pas_can_halve_a_period_every_w_rounds():
    """Spec §3.3's fixed window (the default): a scalar whose R stops falling is halved
    after W rounds, and again W rounds later while it stays stalled, down to τ_min; one whose
    R keeps falling keeps its period. The doubling ablation waits longer every time."""
    params = PASParams(initial_period=64, ema=0.0, window=3)  # θ = 0: R is raw
    assert params.window_rule == "fixed" and params.warmup == 0

    def halvings(params: PASParams) -> list[int]:
        state = PeriodState.fresh(2, params)
        rounds = []
        for r in range(1, 50):
            falling = r / (r + 1)  # scalar 1: R = (1 - a) / (1 + a) falls every round
            deltas = torch.tensor([[1.0, 1.0], [-0.5, -falling]])  # scalar 0: R = 1/3 always
            _, stalled = tune_periods(state, deltas, r, params)
            assert not bool(stalled[1])
            rounds += [r] if bool(stalled[0]) else []
        assert int(state.periods[1]) == 64
        return rounds

    assert halvings(params) == [3, 6, 9, 12]  # 64 → 32 → 16 → 8 → 4 = τ_min, then no more
    # no new low for more than W rounds, W doubling: 3, 6, 12 rounds after a first value
    assert halvings(replace(params, window_rule="doubling")) == [5, 13, 27]
    assert halvings(replace(params, window_rule="one_step")) == [2, 4, 6, 8]


def test_each_scalar_is_halved_when_its_own_consistency_stops_falling():
    # the doubling ablation (GIFT's reference code), which pins the old default's numbers
    params = PASParams(initial_period=64, ema=0.0, window=2, window_rule="doubling")
    state = PeriodState.fresh(3, params)
    halvings = []
    for r in range(1, 13):
        a = min(0.1 * r, 0.4)  # scalar 0: R falls until round 4, then stays flat
        b = 0.05 * r  # scalar 1: R falls every round
        deltas = torch.tensor([[1.0, 1.0, 1.0], [-a, -b, 1.0]])  # scalar 2: always R = 1
        _, stalled = tune_periods(state, deltas, r, params)
        halvings.append(stalled.nonzero().flatten().tolist())
    # scalar 0: low at 4, stall at 7 (W=2), new low at 8, stall at 13 (W=4) - beyond round 12
    # scalar 2: low at 1, stall at 4; new low at 5, stall at 10; scalar 1 never stalls
    assert [r for r, h in enumerate(halvings, 1) if 0 in h] == [7]
    assert [r for r, h in enumerate(halvings, 1) if 2 in h] == [4, 10]
    assert not any(1 in h for h in halvings)
    assert state.periods.tolist() == [32, 64, 16]
    assert state.detector.window.tolist() == [4, 2, 8]


def test_periods_at_the_floor_are_not_halved_and_keep_their_window():
    params = PASParams(initial_period=8, levels=1, ema=0.0, window=1, window_rule="doubling")
    state = PeriodState.fresh(1, params)
    for r in range(1, 11):  # flat R: stall at 3 (8 -> 4 = τ_min), never again
        tune_periods(state, torch.tensor([[1.0], [-0.5]]), r, params)
    assert state.periods.tolist() == [4] and state.detector.window.tolist() == [2]


def _model() -> tuple[nn.Module, Layout]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    return model, Layout.of(model.state_dict())


def _train_content(
    layout: Layout, vector: torch.Tensor, periods: torch.Tensor, **config
) -> RecordDict:
    """What the server sends a new client: the dense model and the periods (via fl.wire.sync)."""
    sync = SyncServer(synced_state(PASParams(initial_period=int(periods.max()))))
    sync.publish(1, {"periods": periods})
    records, _ = sync.records(0, layout)
    return RecordDict({**encode_dense(vector, layout), **records, "config": ConfigRecord(config)})


class _Recording(PASHooks):
    """PASHooks that keep the flat model after every step."""

    def after_step(self, step, model, loss):
        keep_going = super().after_step(step, model, loss)
        self.trace.append(self.layout.flatten(model.state_dict()))
        return keep_going


def test_each_group_stops_at_the_end_of_its_period():
    model, layout = _model()
    start = layout.flatten(model.state_dict())
    periods = torch.tensor([2, 4, 8])[torch.arange(layout.numel) % 3]
    content = _train_content(layout, start, periods, **{"server-round": 3})
    hooks, state = _Recording(PASParams(initial_period=8)), RecordDict()
    hooks.load(model, content, state, layout)
    hooks.trace = [start]
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    settings = TrainSettings(local_steps=8, local_epochs=0, batch_size=8, lr=0.5, momentum=0.9)
    train_locally(model, x, y, hooks, settings)
    trace = torch.stack(hooks.trace)  # (steps + 1, scalars)
    for p in (2, 4, 8):
        group = periods == p
        assert torch.equal(trace[-1][group], trace[p][group])  # frozen since step p
        assert not torch.equal(trace[p][group], trace[p - 1][group])  # moved until step p
    # the reply: one array per group, smallest period first, all scalars once
    records, _ = hooks.end(model, state, layout)
    assert list(records["arrays"].keys()) == ["g2", "g4", "g8"]
    counts = [int((periods == p).sum()) for p in (2, 4, 8)]
    assert group_sizes(periods) == list(zip((2, 4, 8), counts, strict=True))
    assert payload_traffic(RecordDict(records)).payload == 4 * layout.numel
    assert torch.equal(decode(RecordDict(records), layout, groups=periods), trace[-1])


def test_grouped_reply_must_match_the_servers_periods():
    layout = Layout(("w",), ((4,),), (torch.float32,))
    records = RecordDict(encode_grouped(torch.arange(4.0), torch.tensor([4, 8, 4, 8])))
    with pytest.raises(CodecError, match="missing arrays"):
        decode(records, layout, groups=torch.full((4,), 2))
    with pytest.raises(CodecError):
        decode(records, layout, groups=torch.tensor([4, 8, 8, 8]))


def test_periods_travel_as_changes_since_the_version_a_client_holds():
    server = PASServer(PASParams(initial_period=16), seed=0, clients_per_round=2)
    model = nn.Linear(100, 10)  # 1,010 scalars: indices beat a bitmap for five changes
    layout = Layout.of(model.state_dict())
    server.layout, server.global_vector = layout, layout.flatten(model.state_dict())
    server._dense_payload = encode_dense(server.global_vector, layout)
    d = layout.numel

    def start(version: int) -> None:
        server.on_round_start(version)
        server.sync.publish(version, server.synced())

    start(1)
    fresh = payload_traffic(RecordDict(server.train_payload(1, node_id=7)))
    assert (fresh.payload, fresh.control) == (4 * d, 0)  # all still τ_0: nothing to send
    hooks, state = PASHooks(server.params), RecordDict()
    first = RecordDict({**server.train_payload(1, node_id=1), "config": ConfigRecord()})
    hooks.load(model, first, state, layout)
    server.sync.confirm(1, 1)  # node 1 replied to round 1
    shorten(server.control.periods, torch.arange(5), server.params)  # round 1 halved five
    start(2)
    in_sync = RecordDict({**server.train_payload(2, node_id=1), "config": ConfigRecord()})
    new = RecordDict(server.train_payload(2, node_id=2))
    assert 0 < payload_traffic(in_sync).control <= 4 * 5  # indices; the client halves them
    assert in_sync.config_records["sync"]["periods"] == "advance"
    assert 0 < payload_traffic(new).control <= (4 + 2) * 5  # the changes from τ_0
    assert server.train_config(2, 1) == {"local-steps": 16}
    hooks.load(model, in_sync, state, layout)
    assert torch.equal(hooks.periods, server.control.periods)
    hooks.load(model, in_sync, state, layout)  # again (reply lost): it keeps version 1 too
    assert torch.equal(hooks.periods, server.control.periods)
    with pytest.raises(RuntimeError, match="does not hold version 1"):
        hooks.load(model, in_sync, RecordDict(), layout)  # a client that lost its state


def test_upload_parts_credit_groups_that_leave_while_training_goes_on():
    profile = DeviceProfile(speed=100.0, up_bytes_per_s=100.0, down_bytes_per_s=200.0)
    server = PASServer(PASParams(), seed=0, clients_per_round=1)
    # the periods the server sent (12 scalars at τ=10, 38 at τ=20: 48 and 152 bytes),
    # whatever the client claims, plus 20 B of control after the last group
    server.round_periods = torch.tensor([10] * 12 + [20] * 38)
    parts = server.upload_parts(0, 220)
    assert parts == ((0.5, 48), (1.0, 172))
    clock = VirtualClock([profile], seed=0)
    clock.submit(Job(0, 0, down_bytes=200, samples=200, uploads=parts))
    # download 1 s; 200 samples in 2 s; 48 B leave at 2 s (0.48 s), 172 B at 3 s (1.72 s)
    assert clock.next_arrival().arrived_s == pytest.approx(1 + 2 + 1.72)
    server.round_periods = torch.full((50,), 20)
    assert server.upload_parts(0, 200) == ((1.0, 200),)  # one group: FedAvg's sequential time


RUN = [
    "strategy=pas",
    "num_clients=6",
    "clients_per_round=4",
    "local_steps=16",
    "strategy.window=1",
    "strategy.warmup=2",
    "system=heterogeneous",
]


def test_pas_run_diversifies_periods_keeps_fedavg_payload_and_resumes(tmp_path):
    run_fl(tmp_path / "full", *RUN, "rounds=10", fresh=True)
    rows = read_metrics(tmp_path / "full")
    assert all(r["rejected"] == 0 and r["failed"] == 0 for r in rows)
    assert rows[0]["period_histogram"] == {"16": rows[0]["payload_bytes_up"] // 16}
    last = rows[-1]["period_histogram"]
    assert len(last) > 1 and sum(last.values()) == rows[0]["payload_bytes_up"] // 16
    d = sum(last.values())
    assert all(r["payload_bytes_up"] == 4 * 4 * d for r in rows)  # every scalar once a round
    assert any(r["bytes_down"] > r["payload_bytes_down"] for r in rows)  # control traffic
    assert rows[-1]["accuracy"] > 0.5

    run_fl(tmp_path / "resumed", *RUN, "rounds=5")
    run_fl(tmp_path / "resumed", *RUN, "rounds=10", "resume=true")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(rows)
