"""`loop.arrival=real`: rounds close on the order replies reach the server, in wall time.

The round loop, ClientApp and training are real (in-process engine); only the network is
scripted: each partition's reply reaches the server a fixed number of seconds after it
was sent, on a clock the test advances, so the order is known and nothing waits.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from conftest import train_in_process
from flwr.app import Message

import server.loop
from fl.common.config import compose
from fl.run.arrivals import RealArrivals
from fl.run.engines.local import LocalGrid
from fl.run.loops import loop_settings

# Seconds from send to arrival, by partition: the reverse of partition order, so a loop
# that fell back to partition (or virtual) order would land the wrong replies.
DELAYS = {0: 9.0, 1: 7.0, 2: 5.0, 3: 3.0, 4: 1.0, 5: 2.0}
BASE = ["num_clients=6", "local_steps=3", "progress=false", "loop.arrival=real"]


class ScriptedNetwork(LocalGrid):
    """A LocalGrid whose replies become pullable `DELAYS[partition]` seconds after sending."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.now = 0.0
        self.due: list[tuple[float, str, int, Message]] = []  # (arrival, id, seq, reply)
        self.sent: list[int] = []  # partitions, in the order they were asked

    def timer(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        return LocalGrid.pull_messages(self, LocalGrid.push_messages(self, messages))

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        ids = list(LocalGrid.push_messages(self, messages))
        for message, message_id in zip(messages, ids, strict=True):
            partition = self.nodes[message.metadata.dst_node_id]
            self.sent.append(int(partition))
            for reply in LocalGrid.pull_messages(self, [message_id]):  # trains now
                due = self.now + DELAYS[int(partition)]
                heapq.heappush(self.due, (due, message_id, len(self.due), reply))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        ready = [d for d in self.due if d[0] <= self.now and d[1] in wanted]
        self.due = [d for d in self.due if d not in ready]
        heapq.heapify(self.due)
        return [d[3] for d in ready]


def _run(out: Path, monkeypatch, *overrides: str) -> tuple[list[dict[str, Any]], ScriptedNetwork]:
    def scripted(grid: ScriptedNetwork, *args: Any, **kwargs: Any) -> RealArrivals:
        return RealArrivals(grid, *args, timer=grid.timer, sleep=grid.sleep, **kwargs)

    monkeypatch.setattr(server.loop, "RealArrivals", scripted)
    return train_in_process(out, *BASE, *overrides, grid_class=ScriptedNetwork)


def test_semi_async_lands_replies_in_real_arrival_order(tmp_path: Path, monkeypatch) -> None:
    rows, grid = _run(
        tmp_path, monkeypatch, "rounds=3", "loop=semi_async", "loop.buffer_k=2",
        "clients_per_round=6",
    )  # fmt: skip
    # Round 1 closes at the 2nd real arrival: partitions 4 (1 s) and 5 (2 s), at t = 2 s
    # (a poll every 50 ms: the arrival is seen on the first poll at or after it).
    assert rows[0]["replies"] == 2 and rows[0]["staleness_max"] == 0
    assert rows[0]["virtual_time_s"] == pytest.approx(2.0, abs=0.06)
    # 4 and 5 are asked again at t = 2 and land at 3 and 4 s; 3 (sent at 0) lands at 3 s.
    assert grid.sent[:8] == [0, 1, 2, 3, 4, 5, 4, 5]
    assert rows[1]["replies"] == 2 and rows[1]["staleness_max"] == 1  # partition 3
    assert rows[1]["virtual_time_s"] == pytest.approx(3.0, abs=0.06)
    assert [r["round_time_s"] > 0 for r in rows] == [True] * 3


def test_sync_deadline_in_wall_seconds_drops_the_slow(tmp_path: Path, monkeypatch) -> None:
    rows, _ = _run(
        tmp_path, monkeypatch, "rounds=2", "clients_per_round=6", "loop.deadline_s=4"
    )  # fmt: skip
    # Partitions 3, 4, 5 arrive within 4 s; 0, 1, 2 do not and are given up.
    assert [r["replies"] for r in rows] == [3, 3]
    assert [r["missing"] for r in rows] == [3, 3]
    assert rows[0]["round_time_s"] == pytest.approx(4.0, abs=0.06)


def test_first_k_closes_on_the_earliest_real_replies(tmp_path: Path, monkeypatch) -> None:
    rows, _ = _run(
        tmp_path, monkeypatch, "rounds=1", "clients_per_round=6", "loop.first_k_fraction=0.5"
    )  # fmt: skip
    assert rows[0]["replies"] == 3  # partitions 4, 5, 3
    assert rows[0]["round_time_s"] == pytest.approx(3.0, abs=0.06)


def test_unanswered_instructions_are_given_up_and_left_out_of_checkpoints(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setitem(DELAYS, 0, 1e9)  # partition 0 never answers
    rows, grid = _run(
        tmp_path, monkeypatch, "rounds=4", "loop=semi_async", "loop.buffer_k=5",
        "clients_per_round=6", "loop.deadline_s=20",
    )  # fmt: skip
    # Each round closes at its 5th arrival (round 1 at t = 7 s, when partition 1 lands);
    # partition 0 stays in flight until round 3 closes at t = 21 s, past its 20 s.
    assert [r["replies"] for r in rows] == [5] * 4
    assert rows[0]["virtual_time_s"] == pytest.approx(7.0, abs=0.06)
    assert [r["missing"] for r in rows] == [0, 0, 1, 0]
    assert grid.sent.count(0) == 2  # asked again once it was given up


def test_arrival_defaults_to_real_on_deployments_only() -> None:
    assert loop_settings(compose([])).arrival == "virtual"
    assert loop_settings(compose(["engine=flower-sim"])).arrival == "virtual"
    assert loop_settings(compose(["engine=deployment"])).arrival == "real"
    assert loop_settings(compose(["engine=deployment", "loop.arrival=virtual"])).arrival == (
        "virtual"
    )
