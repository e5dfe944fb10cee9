"""APF mechanics against hand-computed cases, and the plugin end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import read_metrics, run_fl
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from clients.trainer import TrainSettings, train_locally
from fl.mechanisms.diagnosis import PerturbationEMA
from fl.run.engines.local import LocalGrid
from fl.wire.codec import payload_traffic
from fl.wire.records import Layout
from fl.wire.sync import SyncServer
from strategies.apf import (
    APFHooks,
    APFParams,
    APFServer,
    FreezingState,
    stability_check,
    synced_state,
)


def _check(state: FreezingState, params: APFParams, delta: float = 1.0) -> None:
    vector = state.at_last_check + delta
    stability_check(state, vector, params, torch.Generator().manual_seed(0))


def test_effective_perturbation_ema_by_hand():
    ema = PerturbationEMA.zeros(2, alpha=0.5)
    everywhere = torch.tensor([True, True])
    assert torch.allclose(ema.update(torch.tensor([1.0, 0.0]), everywhere), torch.ones(2))
    # E = 0.5*0.5 - 0.5 = -0.25, A = 0.5*0.5 + 0.5 = 0.75: P = 1/3 (zig-zag)
    p = ema.update(torch.tensor([-1.0, 0.0]), everywhere)
    assert p[0].item() == pytest.approx(1 / 3)
    assert p[1].item() == 1.0  # never moved: defined unstable, no NaN
    # only selected scalars change
    ema.update(torch.tensor([5.0, 5.0]), torch.tensor([False, True]))
    assert ema.signed[0].item() == pytest.approx(-0.25)


def test_aimd_stable_scalar_frozen_one_then_two_then_three_intervals():
    params = APFParams(threshold=2.0, tighten_above=1.0)  # P <= 1 < 2: always stable
    state = FreezingState.fresh(torch.zeros(1), params)
    active = []
    for _ in range(9):
        _check(state, params)
        active.append(bool(state.active[0]))
    assert active == [False, True, False, False, True, False, False, False, True]
    assert state.length.tolist() == [3]


def test_aimd_unstable_scalar_with_length_three_keeps_one_interval():
    params = APFParams(threshold=1e-9, tighten_above=1.0)  # monotone updates: P = 1, unstable
    state = FreezingState.fresh(torch.zeros(1), params)
    state.length[:] = 3
    _check(state, params)
    assert state.length.tolist() == [1] and not bool(state.active[0])  # 3 // 2 = 1 more interval
    _check(state, params)
    assert bool(state.active[0])
    _check(state, params)
    assert state.length.tolist() == [0] and bool(state.active[0])  # 1 // 2 = 0: active at once


def test_threshold_halves_at_every_check_while_most_is_frozen():
    params = APFParams(threshold=2.0, tighten_above=0.8)
    state = FreezingState.fresh(torch.zeros(10), params)
    _check(state, params, +1.0)  # first check P = 1 < 2: all stable, 100 % frozen
    assert state.threshold == 1.0
    _check(state, params, -1.0)  # all thaw (frozen 1 interval): 0 % frozen, no halving
    assert state.threshold == 1.0 and bool(state.active.all())
    _check(state, params, -1.0)  # E = .99*.01 - .01: P ~ 0.005 < 1, all frozen again
    assert state.threshold == 0.5


def test_frozen_scalars_stay_bit_identical_through_local_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    layout = Layout.of(model.state_dict())
    start = layout.flatten(model.state_dict())
    mask = torch.rand(layout.numel) > 0.5
    sync = SyncServer(synced_state(APFParams()))
    sync.publish(1, {"model": start, "mask": mask})
    records, _ = sync.records(0, layout)  # a new client: dense model, the mask's flips
    content = RecordDict({**records, "config": ConfigRecord({"server-round": 1})})
    hooks, state = APFHooks(APFParams()), RecordDict()
    hooks.load(model, content, state, layout)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    settings = TrainSettings(local_steps=20, local_epochs=0, batch_size=8, lr=0.5, momentum=0.9)
    train_locally(model, x, y, hooks, settings)
    after = layout.flatten(model.state_dict())
    assert torch.equal(after[~mask], start[~mask])
    assert not torch.equal(after[mask], start[mask])
    reply, _ = hooks.end(model, state, layout)
    assert payload_traffic(RecordDict(reply)).payload == 4 * int(mask.sum())


@pytest.mark.parametrize("variant", ["apf_sharp", "apf_plus"])
def test_random_freezing_is_reproducible_and_only_hits_active_scalars(variant):
    params = APFParams(variant=variant, threshold=1e-9, tighten_above=1.0, plus_a1=0.1)
    masks = []
    for seed in (7, 7, 8):
        state = FreezingState.fresh(torch.zeros(2000), params)
        state.until[:1000] = 5  # first half frozen by AIMD until check 5
        state.active[:1000] = False
        stability_check(state, torch.ones(2000), params, torch.Generator().manual_seed(seed))
        masks.append(state.active.clone())
        assert not bool(state.active[:1000].any())
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])
    frozen_share = 1 - masks[0][1000:].float().mean().item()
    expected = 0.5 if variant == "apf_sharp" else 0.1  # min(a1 * K, 0.5) with K = 1
    assert frozen_share == pytest.approx(expected, abs=0.05)


def _apf_on_six_clients(per_round: int) -> tuple[APFServer, LocalGrid, ArrayRecord]:
    """An APF server, six real ClientApps on the in-process grid, and the first model."""
    from clients.app import app as client_app
    from fl.common.config import compose, to_run_config
    from fl.world.task import get_task

    cfg = compose(["strategy=apf", "num_clients=6", f"clients_per_round={per_round}"])
    grid = LocalGrid(client_app, 6, to_run_config(cfg))
    server = APFServer(APFParams(), seed=0, clients_per_round=per_round)
    return server, grid, ArrayRecord(get_task(cfg).new_model().state_dict())


def test_sync_sends_changes_since_the_version_each_client_holds():
    server, grid, arrays = _apf_on_six_clients(3)
    sent1 = list(server.configure_train(1, arrays, ConfigRecord(), grid))
    arrays, _ = server.aggregate_train(1, grid.send_and_receive(sent1))
    freezing = server.freezing
    freezing.until[::2] = freezing.checks + 5  # freeze every other scalar for a while
    freezing.active = freezing.until == freezing.checks
    assert server.diagnostics()["frozen_fraction"] == pytest.approx(0.5, abs=0.01)
    first = {m.metadata.dst_node_id for m in sent1}
    v1 = server.sync.versions[1]["model"]
    sent2 = list(server.configure_train(2, arrays, ConfigRecord(), grid))
    d, bits = server.layout.numel, -(-server.layout.numel // 8)
    changed = int((server.global_vector != v1).sum())  # weights of blank pixels never move
    for message in sent2:
        traffic = payload_traffic(message.content)
        base = message.content.config_records["sync"]["base"]
        if message.metadata.dst_node_id in first:  # the changed values and where they are
            assert base == 1 and changed < d
            assert traffic.payload == 4 * changed  # + a bitmap of where, and the mask's flips
            assert bits < traffic.control <= bits + bits
        else:  # holds nothing: the dense model (and the mask, deflated where smaller)
            assert base == -1 and traffic.payload == 4 * d and 0 < traffic.control <= bits
    replies = list(grid.send_and_receive(sent2))
    assert all(r.has_content() for r in replies)
    frozen, before = ~freezing.active, server.global_vector.clone()
    arrays, _ = server.aggregate_train(2, replies)
    assert server.stats.accepted == 3 and server.stats.rejected == 0
    assert torch.equal(server.global_vector[frozen], before[frozen])
    second = {m.metadata.dst_node_id for m in sent2}
    flips = int((freezing.active != ~frozen).sum())
    for message in server.configure_train(3, arrays, ConfigRecord(), grid):
        traffic = payload_traffic(message.content)
        if message.metadata.dst_node_id in second:  # what round 2 changed, cheapest form:
            trained = int((~frozen).sum())  # its values at the mask the client holds,
            moved = int((server.global_vector != before).sum())  # or the values that moved
            model = min(4 * trained, 4 * moved + bits, 8 * moved)
            assert model < traffic.total <= model + min(4 * flips, bits)
        else:  # more changed since what it holds (or it holds nothing)
            assert traffic.payload > 4 * int((~frozen).sum())


def test_a_node_given_up_on_gets_changes_from_its_confirmed_version():
    """A reply that missed the close does not cost its node a dense resync: the next
    message is relative to the version it last confirmed, which its client still holds."""
    server, grid, arrays = _apf_on_six_clients(6)
    sent = list(server.configure_train(1, arrays, ConfigRecord(), grid))
    arrays, _ = server.aggregate_train(1, grid.send_and_receive(sent))
    sent = list(server.configure_train(2, arrays, ConfigRecord(), grid))
    replies = list(grid.send_and_receive(sent))  # every client trained on version 2, but
    late = {r.metadata.src_node_id for r in replies[3:]}  # three replies miss the close
    arrays, _ = server.aggregate_train(2, replies[:3])
    server.give_up(late)
    messages = list(server.configure_train(3, arrays, ConfigRecord(), grid))
    d = server.layout.numel
    for message in messages:
        sync = message.content.config_records["sync"]
        late_node = message.metadata.dst_node_id in late
        assert sync["base"] == (1 if late_node else 2)
        assert sync["model"] != "dense" and payload_traffic(message.content).payload < 4 * d
    accepted = server.stats.accepted
    server.aggregate_train(3, grid.send_and_receive(messages))
    assert server.stats.accepted - accepted == 6 and server.stats.failed == 0
    assert server.stats.rejected == 0


def test_apf_run_freezes_and_keeps_frozen_values(tmp_path):
    run_fl(
        tmp_path,
        "strategy=apf",
        "strategy.ema_alpha=0.5",
        "strategy.threshold=0.3",
        "num_clients=6",
        "clients_per_round=6",
        "rounds=12",
        "local_steps=5",
    )
    rows = read_metrics(tmp_path)
    assert max(r["frozen_fraction"] for r in rows) > 0.05
    assert all(r["rejected"] == 0 and r["failed"] == 0 for r in rows)
    late = rows[-1]
    assert late["payload_bytes_up"] < rows[0]["payload_bytes_up"]
    assert late["bytes_down"] >= late["payload_bytes_down"]
    assert rows[-1]["accuracy"] > 0.5
