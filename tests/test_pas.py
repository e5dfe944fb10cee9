"""PAS mechanics on hand-built cases (periods, roll-back, groups, bytes, clock), end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import read_metrics, run_fl, without_wall_time
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from clients.trainer import TrainSettings, train_locally
from fl.clock import ClientWork, DeviceProfile, pipelined_seconds, sequential_seconds
from fl.codec import CodecError, encode_dense, payload_traffic
from fl.records import Layout, numpy_to_array
from strategies.pas import (
    PERIODS,
    SHORTENED,
    PASHooks,
    PASParams,
    PASServer,
    PeriodState,
    decode_groups,
    encode_groups,
    group_bytes,
    shorten,
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


def test_each_scalar_is_halved_when_its_own_consistency_stops_falling():
    params = PASParams(initial_period=64, ema=0.0, window=2, warmup=0)  # θ = 0: R is raw
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
    params = PASParams(initial_period=8, levels=1, ema=0.0, window=1, warmup=0)
    state = PeriodState.fresh(1, params)
    for r in range(1, 11):  # flat R: stall at 3 (8 -> 4 = τ_min), never again
        tune_periods(state, torch.tensor([[1.0], [-0.5]]), r, params)
    assert state.periods.tolist() == [4] and state.detector.window.tolist() == [2]


def _model() -> tuple[nn.Module, Layout]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    return model, Layout.of(model.state_dict())


def _train_content(layout: Layout, vector: torch.Tensor, **config) -> RecordDict:
    return RecordDict({**encode_dense(vector, layout), "config": ConfigRecord(config)})


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
    content = _train_content(layout, start, **{"server-round": 3, "pas-base-round": -1})
    content[PERIODS] = ArrayRecord({"periods": numpy_to_array(periods.numpy().astype("int16"))})
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
    assert list(records["arrays"].keys()) == ["p2", "p4", "p8"]
    counts = [int((periods == p).sum()) for p in (2, 4, 8)]
    assert group_bytes(periods) == [(p, 4 * n) for p, n in zip((2, 4, 8), counts, strict=True)]
    assert payload_traffic(RecordDict(records)).payload == 4 * layout.numel
    assert torch.equal(decode_groups(RecordDict(records), periods), trace[-1])


def test_grouped_reply_must_match_the_servers_periods():
    periods = torch.tensor([4, 8, 4, 8])
    records = encode_groups(torch.arange(4.0), periods)
    with pytest.raises(CodecError, match="do not match"):
        decode_groups(RecordDict(records), torch.full((4,), 2))
    with pytest.raises(CodecError, match=r"p4 holds float32 \(2,\), expected float32 \(1,\)"):
        decode_groups(RecordDict(records), torch.tensor([4, 8, 8, 8]))


def test_control_state_out_of_sync_gets_all_periods_in_sync_gets_halved_indices():
    server = PASServer(PASParams(initial_period=16), seed=0, clients_per_round=2)
    model, layout = _model()
    server.layout, server.global_vector = layout, layout.flatten(model.state_dict())
    server._dense_payload = encode_dense(server.global_vector, layout)
    server.on_round_start(1)
    d = layout.numel
    fresh = payload_traffic(RecordDict(server.train_payload(1, node_id=7)))
    assert (fresh.payload, fresh.control) == (4 * d, 0)  # all still τ_0: nothing to send
    server.control.periods[:5] = 8
    server.shortened = torch.arange(5)
    server.replied = {1: 1}
    server.on_round_start(2)
    in_sync = RecordDict(server.train_payload(2, node_id=1))
    late = RecordDict(server.train_payload(2, node_id=2))
    assert payload_traffic(in_sync).control == 4 * 5 and SHORTENED in in_sync.array_records
    assert payload_traffic(late).control == 2 * d and PERIODS in late.array_records
    assert server.train_config(2, 1) == {"local-steps": 16, "pas-base-round": 1}
    assert server.train_config(2, 2)["pas-base-round"] == -1

    # the in-sync client applies the indices to its stored copy; a stale one refuses
    hooks, state = PASHooks(server.params), RecordDict()
    first = _train_content(
        layout, server.global_vector, **{"server-round": 1, "pas-base-round": -1}
    )
    hooks.load(model, first, state, layout)
    in_sync["config"] = ConfigRecord({"server-round": 2, "pas-base-round": 1})
    hooks.load(model, in_sync, state, layout)
    assert torch.equal(hooks.periods, server.control.periods)
    with pytest.raises(RuntimeError, match="not in sync"):
        in_sync["config"] = ConfigRecord({"server-round": 4, "pas-base-round": 3})
        hooks.load(model, in_sync, state, layout)


def test_pipelined_schedule_credits_uploads_that_overlap_training():
    profile = DeviceProfile(speed=100.0, up_bytes_per_s=100.0, down_bytes_per_s=200.0)
    # download 1 s; steps of 0.1 s; group (10 steps, 50 B) ready at 2 s, uploads until 2.5 s;
    # group (20 steps, 150 B) ready at 3 s: 1.5 s upload, done at 4.5 s; + 20 B control
    groups = [(20, 150), (10, 50)]
    seconds = pipelined_seconds(
        profile, down_bytes=200, step_seconds=0.1, groups=groups, extra_up_bytes=20
    )
    assert seconds == pytest.approx(4.7)
    # a big early group still on the link when training ends delays the last one
    assert pipelined_seconds(
        profile, down_bytes=200, step_seconds=0.1, groups=[(10, 250), (20, 150)]
    ) == pytest.approx(1 + 1 + 2.5 + 1.5)
    # through the strategy: the periods the server sent (12 scalars at τ=10, 38 at τ=20:
    # 48 and 152 bytes), whatever the client claims; one group is FedAvg's sequential time
    server = PASServer(PASParams(), seed=0, clients_per_round=1)
    server.round_periods = torch.tensor([10] * 12 + [20] * 38)
    lying = {"steps": 10**9, "pas-group-bytes": [0, 0]}
    work = ClientWork(0, samples=200, down_bytes=200, up_bytes=220, metrics=lying)
    expected = pipelined_seconds(
        profile, down_bytes=200, step_seconds=0.1, groups=[(10, 48), (20, 152)], extra_up_bytes=20
    )
    assert server.client_seconds(profile, work) == pytest.approx(expected)
    server.round_periods = torch.full((50,), 20)
    work = ClientWork(0, samples=200, down_bytes=200, up_bytes=200)
    assert server.client_seconds(profile, work) == pytest.approx(sequential_seconds(profile, work))


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
    run_fl(tmp_path / "full", *RUN, "rounds=10")
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
