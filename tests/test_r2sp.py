"""R2SP and FL-R2SP: the round-robin schedule on the event clock, batch tuning, 1/G scaling,
and real runs on a shared server link (faster rounds than FedAvg, exact resume)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_fl, train_in_process, without_wall_time
from flwr.app import RecordDict

from fl.common.config import ConfigError, compose
from fl.mechanisms.roundrobin import RoundRobin
from fl.run.loops import LoopSettings, RoundDriver, WorkBounds, _reply
from fl.strategy.server import ClientUpdate
from fl.wire.codec import Traffic
from fl.world.clock import DeviceProfile, VirtualClock
from fl.world.population import NodeIds
from strategies.r2sp import FLR2SPParams, R2SPParams, R2SPServer, tuned_batches

FAST = 1e12  # a client link far faster than the server's


def _driver(groups: int, per_group: int, link: float, speed: float) -> RoundDriver:
    """A groups loop with R2SP's schedule over identical devices; node n holds partition n."""
    n = groups * per_group
    clock = VirtualClock([DeviceProfile(speed, FAST, FAST)] * n, seed=0, server_bytes_per_s=link)
    settings = LoopSettings(kind="groups", groups=groups, late="carry")
    return RoundDriver(settings, clock, {i: i for i in range(n)}, math.inf, None, RoundRobin(0.8))


def _idle(driver: RoundDriver) -> list[int]:
    """The nodes the loop may ask now, of all the driver's nodes."""
    nodes = sorted(driver.partitions)
    partitions = np.array([driver.partitions[n] for n in nodes])
    return list(driver.idle(NodeIds(np.array(nodes), partitions)))


def _dispatch(driver: RoundDriver, down: int, samples: int, up: int) -> list[int]:
    """Ask every node the schedule lets start; each reply uploads `up` bytes."""
    nodes = _idle(driver)
    replies = [_reply(node, 1, RecordDict(), None) for node in nodes]
    driver.dispatch(
        1,
        torch.zeros(1),
        replies,
        {node: Traffic(down) for node in nodes},
        {node: WorkBounds(samples, samples) for node in nodes},
        lambda reply, size: ((1.0, up),),
    )
    return nodes


def test_first_cycle_starts_groups_at_offsets_of_r_T_over_G() -> None:
    driver = _driver(groups=4, per_group=2, link=1_000.0, speed=10.0)
    assert _dispatch(driver, down=1_000, samples=100, up=1_000) == list(range(8))
    # T: two downloads and two uploads of 1,000 B sharing 1,000 B/s, 10 s of compute
    period = 2.0 + 10.0 + 2.0
    gap = 0.8 * period / 4
    starts = {node: flight.sent_s for node, flight in driver.flights.items()}
    assert starts == {n: pytest.approx((n % 4) * gap, abs=1e-12) for n in range(8)}
    assert sorted(driver.held) == [1, 2, 3, 5, 6, 7]  # groups 1-3 wait for their start
    assert driver.clock.in_flight() == [0, 4]
    # no transfers overlap (gap 2.8 s > 2 s of transfer): group 0 lands after exactly T,
    # having waited for nobody, and group 1 has started in the meantime
    landed = driver.close(1, 0.0, 8, [])
    assert sorted(landed.info) == [0, 4]
    assert [i.arrived_s for i in landed.info.values()] == pytest.approx([period] * 2, rel=1e-12)
    assert driver.schedule is not None and driver.schedule.period_s == pytest.approx(period)
    assert driver.held == {} and driver.clock.now == pytest.approx(period)
    # group 0 comes round again: its turn, and the last start (3·gap) is more than a gap ago
    assert _idle(driver) == [0, 4]


def test_overlapping_groups_share_the_server_link_up_to_its_capacity() -> None:
    driver = _driver(groups=2, per_group=2, link=1_000.0, speed=100.0)
    _dispatch(driver, down=0, samples=100, up=1_000)
    # T = 1 s compute + 2 s upload; group 1 starts 0.8·3/2 = 1.2 s after group 0, so its
    # uploads (from 2.2 s) overlap group 0's (from 1 s): four flows, a quarter each
    first = driver.close(1, 0.0, 4, [])
    second = driver.close(2, driver.clock.now, 0, [])
    # group 0: 1.2 s at 500 B/s each, its last 400 B at 250 B/s: lands at 2.2 + 1.6
    assert [i.arrived_s for i in first.info.values()] == pytest.approx([3.8, 3.8], rel=1e-12)
    # the link never idles from 1 s on: 4,000 B at 1,000 B/s end at 5 s exactly
    assert [i.arrived_s for i in second.info.values()] == pytest.approx([5.0, 5.0], rel=1e-12)
    assert [i.sent_s for i in second.info.values()] == pytest.approx([1.2, 1.2], rel=1e-12)


def test_a_group_waits_for_its_turn_and_an_absent_group_passes_it() -> None:
    schedule = RoundRobin(0.8)
    schedule.bind(3)
    for group in range(3):
        schedule.release(group, 0.0, 3.0)
    assert schedule.turn == 0
    assert schedule.due(idle={1}, busy={0, 2}) == []  # group 0 still out: 1 waits
    assert schedule.due(idle={0, 1}, busy={2}) == [0, 1]
    assert schedule.due(idle={1}, busy=set()) == [1]  # group 0 unreachable: passes its turn
    assert schedule.release(0, 0.0, 3.0) == pytest.approx(3 * 0.8 * 3.0 / 3)


def test_batch_tuning_fills_idle_time_as_in_r2sp_table_ii() -> None:
    # K520 / K80 / M60: blocking 0 / 0.62 / 0.82 s at 429 / 628 / 917 samples/s, batch 512
    spans = {0: 5.0, 1: 5.0 - 0.62, 2: 5.0 - 0.82}
    speeds = {0: 429.0, 1: 628.0, 2: 917.0}
    assert tuned_batches(spans, speeds, 512, 1, cap=4096) == {0: 512, 1: 901, 2: 1264}
    # spread over 4 local steps, and capped
    assert tuned_batches(spans, speeds, 512, 4, cap=700) == {0: 512, 1: 609, 2: 700}


def _server(params: R2SPParams) -> R2SPServer:
    server = R2SPServer(params, seed=0, clients_per_round=4)
    server.schedule.bind(4)
    server.global_vector = torch.tensor([1.0, 1.0])
    return server


def _update(node: int, vector: list[float], examples: int) -> ClientUpdate:
    return ClientUpdate(node, torch.tensor(vector), examples, {})


def test_fl_r2sp_moves_the_model_by_one_over_g_of_a_group_update_r2sp_by_all() -> None:
    updates = [_update(0, [3.0, 1.0], 1), _update(1, [1.0, 5.0], 3)]  # mean (1.5, 4)
    fl = _server(FLR2SPParams(tune_batches=False, groups=4))
    assert fl.aggregate(2, updates).tolist() == pytest.approx([1.125, 1.75])
    plain = _server(R2SPParams(tune_batches=False))
    assert plain.aggregate(2, updates).tolist() == pytest.approx([1.5, 4.0])
    # a stale update is applied as pushed, without FedAsync's discount
    assert plain.rebase(torch.tensor([2.0, -1.0]), staleness=3).tolist() == [3.0, 0.0]


def test_tuned_batches_reach_clients_with_scaled_learning_rate() -> None:
    server = _server(R2SPParams(batch_size=32, lr=0.1, local_steps=4))
    assert server.train_config(1, 7) == {}  # untuned until measured
    server.batches = {7: 48}
    assert server.train_config(9, 7) == {"batch-size": 48, "lr": pytest.approx(0.15)}


BASE = [
    "num_clients=8",
    "clients_per_round=8",
    "local_steps=10",
    "rounds=8",
    "system=shared_link",
    "progress=false",
    "checkpoint_every=100",
]


def _run(out: Path, *overrides: str) -> list[dict[str, Any]]:
    return train_in_process(out, *BASE, *overrides)[0]


def test_fl_r2sp_cycles_faster_than_fedavg_rounds_on_a_shared_link(tmp_path: Path) -> None:
    fedavg = _run(tmp_path / "fedavg", "rounds=2")
    rows = _run(tmp_path / "fl_r2sp", "strategy=fl_r2sp", "loop=groups", "loop.groups=4")
    assert rows[0]["clients"] == 8 and all(r["replies"] == 2 for r in rows)
    assert max(r["staleness_max"] for r in rows) == 3  # G - 1, R2SP's bound
    # two cycles (every group twice) against two FedAvg rounds (every client twice)
    cycle, round_ = rows[-1]["virtual_time_s"] / 2, fedavg[-1]["virtual_time_s"] / 2
    assert cycle < 0.75 * round_
    assert all(r["period_s"] > 0 and r["gap_s"] == pytest.approx(0.9 * r["period_s"] / 4)
               for r in rows)  # fmt: skip


def test_r2sp_selects_its_loop_and_refuses_one_without_groups(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="strategy=r2sp runs on loop=groups"):
        _run(tmp_path, "strategy=r2sp", "loop=sync")
    assert compose(["strategy=r2sp"]).loop.kind == "groups"


RESUMED = [
    *(o for o in BASE if not o.startswith("rounds=")),
    "strategy=r2sp",
    "loop=groups",
    "loop.groups=4",
    "system.speed_spread=3",
]


@pytest.mark.slow  # an end-to-end run with resume (~20 s); the mechanics have fast tests
def test_r2sp_tunes_batches_and_resumes_to_identical_metrics(tmp_path: Path) -> None:
    args = RESUMED  # checkpoints only at each run's last round
    run_fl(tmp_path / "whole", *args, "rounds=10", fresh=True)
    whole = read_metrics(tmp_path / "whole")
    tuned = [r for r in whole if "batch_mean" in r]
    assert tuned and tuned[0]["round"] >= 8  # after the warm-up cycle and one measured cycle
    assert tuned[0]["batch_mean"] > 32  # faster nodes got larger batches
    run_fl(tmp_path / "split", *args, "rounds=6")  # mid-cycle: spans half measured
    run_fl(tmp_path / "split", *args, "rounds=10", "resume=true")
    assert without_wall_time(read_metrics(tmp_path / "split")) == without_wall_time(whole)
