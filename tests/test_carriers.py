"""Cohorts on flower-sim (fl.run.engines.carriers): envelopes to carrier nodes.

In process, with the local grid standing in for Flower's simulation (each node answers one
message at a time through the very ClientApp): a run with `engine.cohort=auto` ends with
the per-node run's metrics within `METRIC_TOLERANCE` (counts, bytes and virtual time
exactly), stateful client halves keep their state with their carrier, what cannot train as
a cohort is carried node by node with bit-identical numbers, and a carrier's malformed
reply fails its members, not the round. The real Ray run is in test_engine_flower_sim.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import train_in_process, without_wall_time
from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict

from clients.cohort import METRIC_TOLERANCE
from fl.common.config import compose
from fl.run.engines import carriers
from fl.run.engines.carriers import (
    ENVELOPE,
    keep_member_states,
    member_context,
    member_states,
    open_envelope,
    open_replies,
    seal_envelope,
    seal_replies,
)
from fl.run.validation import validate

SIM = ("engine=flower-sim", "rounds=3", "progress=false", "plots=false")
EXACT = ("round", "virtual_time_s", "bytes_up", "bytes_down", "replies", "failed")


def _both(
    tmp_path: Path, *overrides: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The run node by node, then on carriers: both runs' rows, and how many fewer
    messages the nodes handled on carriers."""
    alone, by_node = train_in_process(tmp_path / "alone", *SIM, *overrides)
    carried, grid = train_in_process(tmp_path / "carried", *SIM, *overrides, "engine.cohort=auto")
    return alone, carried, by_node.built - grid.built


@pytest.mark.parametrize(
    "overrides",
    [
        ("num_clients=20", "clients_per_round=10"),
        ("strategy=fedsu", "num_clients=12", "clients_per_round=12"),  # state kept per member
        (
            "strategy=asfl",
            "loop=semi_async",
            "system=heterogeneous",
            "num_clients=12",
            "clients_per_round=6",
        ),
        (
            "strategy=fedprox",
            "strategy.mu=0.1",
            "engine.cohorts=3",
            "num_clients=15",
            "clients_per_round=15",
        ),
    ],
    ids=["fedavg", "fedsu", "asfl", "fedprox-3"],
)
def test_carried_cohorts_end_with_the_per_node_metrics(tmp_path, caplog, overrides):
    with caplog.at_level(logging.INFO, logger=carriers.__name__):
        alone, carried, fewer = _both(tmp_path, *overrides)
    assert "on carriers, cohort: " in caplog.text  # the run says which path it took
    assert fewer >= sum(r["replies"] for r in carried) / 2  # a carrier took many as one
    assert len(alone) == len(carried) == 3
    for a, b in zip(alone, carried, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if key in EXACT:
                assert b[key] == value, key
            elif isinstance(value, float) and key != "wall_time_s":
                assert b[key] == pytest.approx(value, **METRIC_TOLERANCE), key


@pytest.mark.parametrize(
    "overrides, path",
    [
        (("strategy=apf",), "on carriers, per client: strategy apf"),
        (("privacy=dpsgd",), "on carriers, per client: privacy=dpsgd"),
        (("faults.dropout=0.2",), "node by node: faults or attacks"),
    ],
)
def test_what_is_not_cohort_safe_gives_the_per_node_numbers_bit_for_bit(
    tmp_path, caplog, overrides, path
):
    with caplog.at_level(logging.INFO, logger=carriers.__name__):
        alone, carried, _fewer = _both(tmp_path, "num_clients=8", "clients_per_round=8", *overrides)
    assert path in caplog.text
    assert without_wall_time(alone) == without_wall_time(carried)


def test_engine_cohorts_is_checked_before_the_run():
    with pytest.raises(ValueError, match=r"engine\.cohorts"):
        validate(compose(["engine=flower-sim", "engine.cohort=auto", "engine.cohorts=0"]))
    with pytest.raises(ValueError, match=r"engine\.cohort"):
        validate(compose(["engine=flower-sim", "engine.cohort=yes"]))
    validate(compose(["engine=flower-sim", "engine.cohort=auto"]))


# ----- the envelope, message by message ---------------------------------------------------
def _member(node: int, value: float) -> Message:
    content = RecordDict({"config": ConfigRecord({"x": value})})
    return Message(content, node, MessageType.TRAIN, group_id="4")


def _envelope() -> tuple[Message, list[Message]]:
    members = [_member(11, 1.0), _member(12, 2.0), _member(2**63 + 5, 3.0)]
    partitions = {11: 1, 12: 3, 2**63 + 5: 5}
    return seal_envelope(members, 11, partitions, 6), members


def test_an_envelope_carries_each_member_as_its_own_node_would_get_it():
    envelope, members = _envelope()
    assert envelope.metadata.dst_node_id == 11 and envelope.metadata.group_id == "4"
    opened = open_envelope(envelope)
    assert [m.node for m in opened] == [11, 12, 2**63 + 5]  # beyond a signed int64 too
    assert [m.partition for m in opened] == [1, 3, 5]
    for member, sent in zip(opened, members, strict=True):
        assert member.message.metadata.dst_node_id == sent.metadata.dst_node_id
        assert member.message.content["config"]["x"] == sent.content["config"]["x"]
        assert list(member.message.content.keys()) == ["config"]


@pytest.mark.parametrize(
    "tamper, match",
    [
        (lambda c: c.__setitem__("7/config", ConfigRecord({})), "names no member"),
        (lambda c: c.__setitem__("stray", ConfigRecord({})), "names no member"),
        (lambda c: c[ENVELOPE].__setitem__("partitions", [1, 3, 9]), "partitions alike"),
        (lambda c: c[ENVELOPE].__setitem__("nodes", ["11", "-1", "5"]), "partitions alike"),
        (lambda c: c[ENVELOPE].__setitem__("nodes", [11, 12, 13]), "list of str"),
        (lambda c: c[ENVELOPE].__setitem__("num-partitions", 0), "num-partitions"),
    ],
)
def test_a_malformed_envelope_is_refused(tamper, match):
    envelope, _ = _envelope()
    tamper(envelope.content)
    with pytest.raises(ValueError, match=match):
        open_envelope(envelope)


def test_a_member_state_lives_with_its_carrier_under_its_own_node_id():
    envelope, _ = _envelope()
    carrier = Context(run_id=1, node_id=11, node_config={}, state=RecordDict(), run_config={})
    first, second, _ = open_envelope(envelope)
    states = member_states(carrier)
    ctx = member_context(carrier, second, states)
    assert ctx.node_id == 12 and ctx.node_config == {"partition-id": 3, "num-partitions": 6}
    ctx.state["feedback"] = ConfigRecord({"n": 1})
    mine = member_context(carrier, first, states)
    mine.state["feedback"] = ConfigRecord({"n": 7})
    keep_member_states(carrier, states)
    assert member_context(carrier, second, member_states(carrier)).state["feedback"]["n"] == 1
    states = member_states(carrier)
    ctx = member_context(carrier, second, states)
    del ctx.state["feedback"]
    keep_member_states(carrier, states)  # a state emptied by the member is emptied here too
    assert list(carrier.state.keys()) == ["11/feedback"]


def _reply_of(envelope: Message) -> Message:
    """A carrier's well-formed reply: member 0 answers, 1 failed, 2 sent nothing."""
    members = [m.message for m in open_envelope(envelope)]
    ok = Message(RecordDict({"metrics": ConfigRecord({"loss": 0.5})}), reply_to=members[0])
    failed = Message(Error(3, "ValueError: bad batch"), reply_to=members[1])
    return seal_replies(envelope, [ok, failed, None], "cohort: 1 clients of fedavg in one batch")


def test_a_carriers_reply_opens_into_its_members_replies():
    envelope, members = _envelope()
    envelope.metadata.__dict__["_message_id"] = "e1"
    opened, path = open_replies(_reply_of(envelope), members)
    assert path.startswith("cohort: 1 clients")
    assert [m.metadata.src_node_id for m in opened] == [11, 12]  # the third sent nothing
    assert opened[0].content["metrics"]["loss"] == 0.5
    assert opened[1].has_error() and opened[1].error.reason == "ValueError: bad batch"


@pytest.mark.parametrize(
    "tamper",
    [
        lambda c: c.__setitem__("3/metrics", ConfigRecord({})),  # a member it was not sent
        lambda c: c.__setitem__("x", ConfigRecord({})),
        lambda c: c[ENVELOPE].__setitem__("error-members", [1, 1]),
        lambda c: c[ENVELOPE].__setitem__("error-members", [5]),
        lambda c: c[ENVELOPE].__setitem__("error-codes", ["3"]),
        lambda c: c.__delitem__(ENVELOPE),
    ],
)
def test_a_malformed_reply_fails_every_member_it_carried(tamper):
    envelope, members = _envelope()
    reply = _reply_of(envelope)
    tamper(reply.content)
    opened, path = open_replies(reply, members)
    assert path == "malformed"
    assert len(opened) == 3 and all(m.has_error() for m in opened)
    assert "malformed reply from its carrier" in opened[0].error.reason


def test_a_failed_carrier_fails_its_members_and_the_round_goes_on(tmp_path, monkeypatch):
    real_seal = carriers.seal_replies

    def corrupt(envelope: Message, replies: Any, path: str, *batch: Any) -> Message:
        reply = real_seal(envelope, replies, path, *batch)
        if envelope.metadata.dst_node_id == min(_carriers):  # one carrier answers garbage
            reply.content["99/metrics"] = ConfigRecord({"loss": 0.0})
        return reply

    import clients.app

    _carriers: list[int] = []
    real_grid = carriers.CarrierGrid.__init__

    def remember(self: Any, *args: Any, **kwargs: Any) -> None:
        real_grid(self, *args, **kwargs)
        _carriers.extend(self.carriers)

    monkeypatch.setattr(carriers.CarrierGrid, "__init__", remember)
    monkeypatch.setattr(clients.app, "seal_replies", corrupt)
    rows, _ = train_in_process(
        tmp_path, *SIM, "num_clients=8", "clients_per_round=8", "engine.cohort=auto"
    )
    assert [r["replies"] for r in rows] == [4, 4, 4]  # the other carrier's members count
    assert [r["failed"] for r in rows] == [4, 4, 4]
    assert rows[-1]["accuracy"] > 0.3
