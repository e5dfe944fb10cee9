"""SAFA's two mechanics in ASFL's protocol: forced resync of deprecated nodes and CFCFM
(compensatory first-come-first-merge), on the round driver and in the strategy, and a
short run that departs from the protocol without them only where they apply."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from conftest import train_in_process, without_wall_time
from flwr.app import RecordDict

from fl.run.loops import LoopSettings, RoundDriver, WorkBounds, _reply
from fl.strategy.server import ClientUpdate, ReplyInfo
from fl.wire.codec import Traffic
from fl.world.clock import DeviceProfile, VirtualClock
from fl.world.population import NodeIds
from strategies.asfl import ASFLParams, ASFLServer, CacheEntry, deprecate, draft

FAST = 1e12  # links that take no time: arrivals are in compute order


def _driver(speeds: list[float]) -> RoundDriver:
    """A semi-async loop over devices of these speeds; node n holds partition n."""
    clock = VirtualClock([DeviceProfile(s, FAST, FAST) for s in speeds], seed=0)
    settings = LoopSettings(kind="semi_async", late="carry")
    return RoundDriver(settings, clock, {n: n for n in range(len(speeds))}, math.inf)


def _dispatch(driver: RoundDriver, server_round: int, nodes: list[int]) -> None:
    """Send `nodes` 100 samples of work each."""
    driver.dispatch(
        server_round,
        torch.zeros(1),
        [_reply(n, server_round, RecordDict(), None) for n in nodes],
        {n: Traffic(0) for n in nodes},
        {n: WorkBounds(100, 100) for n in nodes},
        lambda reply, size: ((1.0, 0),),
    )


def _landed_order(driver: RoundDriver, server_round: int, **close: object) -> list[int]:
    landed = driver.close(server_round, driver.clock.now, 0, [], **close)  # type: ignore[arg-type]
    return sorted(landed.info, key=lambda n: landed.info[n].arrived_s)


def test_a_reserve_closes_the_round_only_where_the_others_cannot_fill_it():
    # arrival order = node order (speed falls with the node id)
    speeds = [100.0, 90.0, 80.0, 70.0, 60.0, 50.0]
    plain = _driver(speeds)
    _dispatch(plain, 1, list(range(6)))
    assert _landed_order(plain, 1, buffer_k=3) == [0, 1, 2]  # no reserve: the first three
    preferred = _driver(speeds)
    _dispatch(preferred, 1, list(range(6)))
    # 0 and 1 were picked last round: 2, 3, 4 fill the quota; 0 and 1 land as well
    assert _landed_order(preferred, 1, buffer_k=3, reserve={0, 1}) == [0, 1, 2, 3, 4]
    short = _driver(speeds)
    _dispatch(short, 1, list(range(6)))
    # only 4 and 5 are preferred: the round waits for both, topped up by the first reserve
    assert _landed_order(short, 1, buffer_k=3, reserve={0, 1, 2, 3}) == [0, 1, 2, 3, 4, 5]
    topped = _driver(speeds)
    _dispatch(topped, 1, list(range(6)))
    # the preferred 0 lands first, then reserve arrivals top up once 0 is all there is
    assert _landed_order(topped, 1, buffer_k=3, reserve={1, 2, 3, 4, 5}) == [0, 1, 2]


def test_cancelled_nodes_are_idle_and_can_be_sent_again():
    driver = _driver([1.0, 100.0, 100.0])
    _dispatch(driver, 1, [0, 1, 2])
    driver.close(1, 0.0, 3, [], buffer_k=2)
    assert driver.in_flight() == {0: 1}
    assert driver.cancel([0, 1, 7]) == [0]  # only what is in flight
    assert driver.in_flight() == {} and driver.clock.in_flight() == []
    nodes = NodeIds(np.arange(3, dtype=np.uint64), np.arange(3))
    assert list(driver.idle(nodes)) == [0, 1, 2]
    _dispatch(driver, 2, [0])
    assert driver.in_flight() == {0: 2}


def _server(**params: object) -> ASFLServer:
    values = {"policy": "fixed", "fixed_quota": 0.3, "fixed_lag": 2, **params}
    return ASFLServer(ASFLParams(**values), seed=0, clients_per_round=10)  # type: ignore[arg-type]


def test_resync_cancels_deprecated_flights_and_their_entries_become_the_global_model():
    server = _server(resync=True)
    server.global_vector = torch.full((2,), 5.0)  # W(t-1) at round 6
    server.cache = {
        3: CacheEntry(torch.zeros(2), 20, version=2),  # lag 4 > τ 2: deprecated
        4: CacheEntry(torch.ones(2), 10, version=5),  # lag 1: tolerated
    }
    assert server.resync(6, {3: 3, 4: 5, 8: 4}) == [3]  # sent in round 3: 6 - 3 > 2
    assert server.diagnostics()["resynced"] == 1
    server.expect({4: ReplyInfo(sent_round=5, staleness=1, arrived_s=1.0, base=torch.ones(2))})
    merged = server.aggregate(6, [ClientUpdate(4, torch.full((2,), 7.0), 10, {}, 1, 1.0)])
    assert server.cache[3].version == 6 and server.cache[3].examples == 20
    assert torch.equal(server.cache[3].vector, torch.full((2,), 5.0))  # W(t-1), not dropped
    assert torch.allclose(merged, (20 * 5.0 + 10 * 3.0) / 30 * torch.ones(2))  # base 1 + step 2
    assert _server().resync(6, {3: 3}) == []  # without resync nothing is cancelled
    cache = {3: CacheEntry(torch.zeros(2), 20, version=2)}
    deprecate(cache, [], 6, 2)
    assert cache == {}  # and a deprecated entry is dropped, as before


def _arrival(node: int, at: float) -> ClientUpdate:
    return ClientUpdate(node, torch.full((2,), float(node)), 10, {}, 0, at)


def test_cfcfm_picks_the_preferred_first_then_tops_up_in_arrival_order():
    updates = [_arrival(1, 0.5), _arrival(2, 0.1), _arrival(3, 0.3), _arrival(4, 0.2)]
    picked, undrafted = draft(updates, {2, 4}, 3)  # 2 and 4 were picked last round
    assert [u.node_id for u in picked] == [3, 1, 2]  # P by arrival, then Q's earliest
    assert [u.node_id for u in undrafted] == [4]
    picked, undrafted = draft(updates, set(), 2)  # P over the quota: its earliest
    assert [u.node_id for u in picked] == [2, 4] and [u.node_id for u in undrafted] == [3, 1]


def test_undrafted_replies_enter_the_cache_after_the_merge():
    server = _server(cfcfm=True, fixed_quota=0.2)  # K = 2
    server.global_vector = torch.zeros(2)
    server.picked = [2, 4]
    server.on_round_start(1)
    assert server.reserve_arrivals(1) == {2, 4} and server.picked == []
    updates = [_arrival(1, 0.5), _arrival(2, 0.1), _arrival(3, 0.3), _arrival(4, 0.2)]
    merged = server.aggregate(1, updates)
    assert torch.allclose(merged, torch.full((2,), 2.0))  # nodes 3 and 1 (then Q's 4: no)
    assert server.picked == [1, 3] and sorted(server.cache) == [1, 2, 3, 4]  # bypass
    assert server.diagnostics()["undrafted"] == 2
    server.on_round_start(2)
    assert server.reserve_arrivals(2) == {1, 3}
    assert _server().reserve_arrivals(1) == frozenset()  # without cfcfm every arrival counts


RUN = (
    "strategy=safa",
    "system=heterogeneous",
    "clients_per_round=6",
    "num_clients=10",
    "local_epochs=1",
    "strategy.fixed_lag=1",
    "rounds=6",
    "progress=false",
    "plots=false",
)


def _first_applied(rows: list[dict], *columns: str) -> int:
    """Index of the first round in which one of the rules acted."""
    return next(i for i, r in enumerate(rows) if any(r[c] for c in columns))


def test_safa_departs_from_the_old_protocol_only_where_its_rules_apply(tmp_path: Path):
    off = ("strategy.resync=false", "strategy.cfcfm=false")
    old, _ = train_in_process(tmp_path / "old", *RUN, *off)
    assert not any(r["resynced"] or r["undrafted"] for r in old)
    for name, rule, column in (
        ("resync", "strategy.cfcfm=false", "resynced"),
        ("cfcfm", "strategy.resync=false", "undrafted"),
        ("both", "strategy.resync=true", "resynced"),
    ):
        new, _ = train_in_process(tmp_path / name, *RUN, rule)
        first = _first_applied(new, "resynced", "undrafted")
        assert new[first][column], name  # the rule acted...
        # ...and nothing differed before it did
        assert without_wall_time(new[:first]) == without_wall_time(old[:first]), name
        assert new[first] != old[first], name
