"""Loop kinds on the event-driven clock: sync with first-k and deadlines, semi-async, groups.

Each run is the real round loop on the in-process engine (real training, real ClientApp).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from conftest import train_in_process, without_wall_time

import clients.app as client
from fl.common.config import ConfigError, compose
from fl.run.validation import validate

BASE = [
    "num_clients=8",
    "clients_per_round=8",
    "local_steps=5",
    "progress=false",
    "system=heterogeneous",
]


def _run(out: Path, *overrides: str) -> list[dict[str, Any]]:
    return train_in_process(out, *BASE, *overrides)[0]


def test_first_k_aggregates_exactly_the_earliest_half_and_shortens_rounds(tmp_path: Path) -> None:
    plain = _run(tmp_path / "sync", "rounds=3")
    half = _run(tmp_path / "half", "rounds=3", "loop.first_k_fraction=0.5")
    assert [r["replies"] for r in plain] == [8, 8, 8]
    assert [r["replies"] for r in half] == [4, 4, 4]
    assert [r["missing"] for r in half] == [4, 4, 4]  # the late half is dropped, not waited for
    # Round 1 sends the same model to the same devices: the half closes at the 4th arrival.
    assert half[0]["round_time_s"] < plain[0]["round_time_s"]
    assert sum(r["round_time_s"] for r in half) < 0.8 * sum(r["round_time_s"] for r in plain)
    assert half[0]["bytes_up"] == plain[0]["bytes_up"] // 2  # only landed replies count


def test_a_dropped_reply_whose_message_arrived_costs_no_resync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The late half of a first-k round downloaded its message before the close: the next
    round sends it changes from that version, as it does the half that landed."""
    from fl.wire.sync import SyncServer

    bases: dict[int, list[int]] = {}
    records = SyncServer.records

    def recorded(self: SyncServer, node: int, layout: Any) -> Any:
        out = records(self, node, layout)
        bases.setdefault(self.current, []).append(out[1])
        return out

    monkeypatch.setattr(SyncServer, "records", recorded)
    rows = _run(tmp_path, "rounds=3", "loop.first_k_fraction=0.5", "strategy=apf")
    assert [r["missing"] for r in rows] == [4, 4, 4]
    assert bases == {1: [-1] * 8, 2: [1] * 8, 3: [2] * 8}  # none resynced dense


def test_deadline_drops_what_has_not_arrived(tmp_path: Path) -> None:
    plain = _run(tmp_path / "sync", "rounds=1")
    cut = 0.6 * plain[0]["round_time_s"]
    rows = _run(tmp_path / "cut", "rounds=1", f"loop.deadline_s={cut}")
    assert 0 < rows[0]["replies"] < 8
    assert rows[0]["replies"] + rows[0]["missing"] == 8
    assert rows[0]["round_time_s"] == pytest.approx(cut)


def test_semi_async_reports_staleness_and_closes_at_the_kth_arrival(tmp_path: Path) -> None:
    rows = _run(tmp_path, "rounds=6", "loop=semi_async", "loop.buffer_k=2", "clients_per_round=4")
    assert [r["replies"] for r in rows] == [2] * 6
    assert rows[0]["clients"] == 4  # then only as many as landed are replaced
    assert all(r["clients"] == 2 for r in rows[1:])
    assert rows[0]["staleness_max"] == 0
    assert max(r["staleness_max"] for r in rows) >= 1  # slow devices' replies land later
    assert all(0 <= r["staleness_mean"] <= r["staleness_max"] for r in rows)
    times = [r["virtual_time_s"] for r in rows]
    assert times == sorted(times)


def test_sync_with_carry_lands_late_replies_in_a_later_round(tmp_path: Path) -> None:
    rows = _run(
        tmp_path, "rounds=4", "loop.first_k_fraction=0.5", "loop.late=carry", "clients_per_round=4"
    )
    assert rows[0]["replies"] == 2
    assert max(r["staleness_max"] for r in rows) >= 1


def test_groups_land_one_whole_group_per_round(tmp_path: Path) -> None:
    rows = _run(tmp_path, "rounds=4", "loop=groups", "loop.groups=2")
    assert rows[0]["clients"] == 8  # both groups start
    assert all(r["replies"] == 4 for r in rows)  # partitions p with p % 2 == g
    assert all(r["clients"] in (0, 4) for r in rows[1:])  # the landed group goes again


def test_semi_async_resumes_exactly_mid_flight(tmp_path: Path) -> None:
    args = ["loop=semi_async", "loop.buffer_k=2", "clients_per_round=4"]
    whole = _run(tmp_path / "whole", "rounds=5", *args)
    _run(tmp_path / "split", "rounds=2", *args)
    resumed = _run(tmp_path / "split", "rounds=5", "resume=true", *args)
    assert without_wall_time(resumed) == without_wall_time(whole)


def test_server_link_sharing_slows_a_round(tmp_path: Path) -> None:
    same = ["rounds=1", "system=uniform", "partition=iid"]  # equal work: transfers coincide
    alone = _run(tmp_path / "free", *same)
    shared = _run(tmp_path / "shared", *same, "system.server_bandwidth_mbps=10")
    # 8 equal downloads, then 8 equal uploads, start together on a 10 Mbit/s server link
    # (each direction): each gets an eighth of it instead of its own 50 / 10 Mbit/s.
    size, link = shared[0]["bytes_up"] / 8, 10e6 / 8
    extra = (8 * size / link - size / (5 * link)) + (8 * size / link - size / link)
    assert shared[0]["round_time_s"] - alone[0]["round_time_s"] == pytest.approx(extra, rel=1e-9)


def test_aggregation_time_is_charged_per_reply(tmp_path: Path) -> None:
    plain = _run(tmp_path / "a", "rounds=1")
    slow = _run(tmp_path / "b", "rounds=1", "system.aggregation_s_per_update=0.5")
    assert slow[0]["round_time_s"] == pytest.approx(plain[0]["round_time_s"] + 8 * 0.5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=apf", "loop=semi_async"], "strategy=apf needs every reply in the round"),
        (["strategy=pas", "local_steps=8", "loop.late=carry"], "strategy=pas needs every reply"),
        (["loop.first_k_fraction=1.5"], "loop.first_k_fraction"),
        (["loop=semi_async", "loop.buffer_k=99"], "loop.buffer_k"),
        (["loop.kind=async"], "loop.kind"),
    ],
)
def test_invalid_loop_settings_are_refused_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(compose([*BASE, *overrides]))


def test_clients_see_their_device_and_deadline(tmp_path: Path, monkeypatch) -> None:
    seen: list[dict[str, Any]] = []
    original = client.ClientTime.from_config

    def spy(config: Any, down_bytes: int) -> Any:
        view = original(config, down_bytes)
        seen.append({"speed": view.speed, "deadline": view.deadline_s, "down": view.download_s})
        return view

    monkeypatch.setattr(client.ClientTime, "from_config", spy)
    _run(tmp_path, "rounds=1", "system=uniform", "loop.deadline_s=100")
    assert len(seen) == 8
    assert all(v["speed"] == 500.0 and v["deadline"] == 100.0 for v in seen)
    assert all(math.isclose(v["down"], 4810 * 4 / (50e6 / 8)) for v in seen)


def test_a_strategy_sets_its_own_semi_async_close_per_round(tmp_path: Path, monkeypatch) -> None:
    from fl.strategy.server import ServerStrategy

    monkeypatch.setattr(
        ServerStrategy, "arrivals_to_close", lambda self, rnd: 1 if rnd == 2 else None
    )
    rows = _run(tmp_path, "rounds=3", "loop=semi_async", "loop.buffer_k=2", "clients_per_round=4")
    assert [r["replies"] for r in rows] == [2, 1, 2]  # an ASFL-style controller's choice


def test_a_strategy_runs_several_exchanges_per_round_each_accounted(
    tmp_path: Path, monkeypatch
) -> None:
    from fl.strategy.server import ServerStrategy

    one = _run(tmp_path / "one", "rounds=2", "clients_per_round=4")
    monkeypatch.setattr(ServerStrategy, "another_exchange", lambda self, rnd, done: done < 3)
    three = _run(tmp_path / "three", "rounds=2", "clients_per_round=4")
    first, single = three[0], one[0]
    assert first["clients"] == 3 * single["clients"] == 12
    assert first["replies"] == 12 and first["missing"] == 0
    assert first["bytes_down"] == 3 * single["bytes_down"]  # every exchange's bytes count
    assert first["bytes_up"] == 3 * single["bytes_up"]
    assert three[1]["cum_bytes_up"] == 6 * single["bytes_up"]
    # time: the first exchange is the single run's round 1; two more follow it
    assert first["round_time_s"] > 2 * single["round_time_s"]
    assert three[1]["virtual_time_s"] == pytest.approx(
        first["round_time_s"] + three[1]["round_time_s"]
    )
    assert first["loss"] < single["loss"]  # the model moved three times
