"""A client's strings reach our logs bounded and escaped (issue 36, class 5): a 200 kB
error reason full of terminal escapes becomes one short printable line."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from fl.common.text import SHOWN_CHARS, shown
from fl.run.engines.carriers import open_envelope, open_replies, seal_envelope, seal_replies
from fl.run.engines.local import LocalGrid
from fl.strategy.server import ServerStrategy
from fl.wire.codec import encode_dense
from fl.wire.contract import CONTRACT_MISMATCH, ContractMismatch, check_reply_error
from fl.wire.records import Layout
from strategies.fedavg import FedAvgParams

# 200 kB: clear the screen, move the cursor, set the title, a fake log line after a CR
HOSTILE = ("\x1b[2J\x1b[H\x1b]0;pwned\x07\r\nINFO all fine\u202e" * 7000)[:200_000]


@pytest.fixture(autouse=True)
def _grid() -> LocalGrid:
    """A local grid, which also gives messages their run identity."""
    return LocalGrid(None, 1, {})  # type: ignore[arg-type]  # the node is never called


def _printable(text: str) -> bool:
    return all(c.isprintable() for c in text)


def test_shown_bounds_and_escapes_every_control_character() -> None:
    text = shown(HOSTILE)
    assert len(text) < SHOWN_CHARS * 6 and text.endswith("(200000 characters)")
    assert _printable(text) and "\\x1b[2J" in text and "\\u202e" in text
    assert shown("node 3: bad batch") == "node 3: bad batch"  # plain text is left alone


def _member(node: int) -> Message:
    return Message(RecordDict({"config": ConfigRecord({"x": 1.0})}), node, MessageType.TRAIN)


def test_a_carriers_error_reasons_reach_the_members_bounded_and_escaped() -> None:
    members = [_member(11), _member(12)]
    envelope = seal_envelope(members, 11, {11: 0, 12: 1}, 2)
    inside = [m.message for m in open_envelope(envelope)]
    failed = [Message(Error(3, HOSTILE), reply_to=m) for m in inside]
    opened, _ = open_replies(seal_replies(envelope, failed, "cohort"), members)
    whole = Message(Error(3, HOSTILE), reply_to=envelope)  # the carrier itself failed
    opened += open_replies(whole, members)[0]
    for reply in opened:
        assert reply.has_error() and _printable(reply.error.reason)
        assert len(reply.error.reason) < SHOWN_CHARS * 6


GLOBAL = {"w": torch.zeros(3)}


@pytest.mark.parametrize("hostile", ["reason", "metric key"])
def test_a_replys_strings_are_logged_bounded_and_escaped(hostile: str, caplog, _grid) -> None:
    strategy = ServerStrategy(FedAvgParams(), seed=0, clients_per_round=1)
    (instruction,) = strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), _grid)
    if hostile == "reason":
        reply = Message(Error(3, HOSTILE), reply_to=instruction)
    else:
        metrics = MetricRecord({"num-examples": 5, "train-loss": 0.5, HOSTILE: float("nan")})
        content = {**encode_dense(torch.zeros(3), Layout.of(GLOBAL)), "metrics": metrics}
        reply = Message(RecordDict(content), reply_to=instruction)
    with caplog.at_level(logging.WARNING):
        assert strategy.aggregate_train(1, [reply]) == (None, None)
    (record,) = [r for r in caplog.records if "node" in r.getMessage()]
    line = record.getMessage()
    assert _printable(line) and len(line) < SHOWN_CHARS * 6 + 100, len(line)
    assert all(_printable(r) and len(r) < SHOWN_CHARS * 6 + 100 for r in strategy.stats.reasons)


def test_a_contract_mismatch_names_the_nodes_reason_bounded() -> None:
    reply = Message(Error(CONTRACT_MISMATCH, HOSTILE), reply_to=_member(5))
    with pytest.raises(ContractMismatch) as err:
        check_reply_error(reply)
    assert _printable(str(err.value)) and len(str(err.value)) < SHOWN_CHARS * 6 + 100
