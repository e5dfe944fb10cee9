"""A cohort's one reply (`fl.wire.cohort_reply`): the same run as one reply per member,
checked as a batch on the server, each bad member rejected alone, a malformed reply
rejected without touching the model."""

from __future__ import annotations

import functools
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import train_in_process, without_wall_time
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fl.run.engines.local import LocalGrid
from fl.strategy.server import ServerStrategy
from fl.wire.codec import encode_dense
from fl.wire.cohort_reply import COHORT, COHORT_METRICS, pack_cohort, parse_cohort
from fl.wire.contract import NONCE_KEY
from fl.wire.records import Layout
from strategies.fedavg import FedAvgParams

GLOBAL = {"w": torch.linspace(-1, 1, 12).reshape(3, 4), "b": torch.zeros(4)}
LAYOUT = Layout.of(GLOBAL)
NODES = 5


# ----- whole runs ------------------------------------------------------------------------
def _run(tmp_path: Path, name: str, *overrides: str, **grid: Any) -> tuple[list[Any], LocalGrid]:
    common = ("rounds=2", "num_clients=12", "clients_per_round=8", "progress=false")
    common += ("engine.cohort=auto",)  # the run's server then takes a cohort's one reply
    return train_in_process(
        tmp_path / name,
        *common,
        "plots=false",
        *overrides,
        grid_class=functools.partial(LocalGrid, cohort=True, **grid),
    )


@pytest.mark.parametrize("serialize", [False, True])
def test_one_cohort_reply_gives_the_per_member_replies_run_bit_for_bit(tmp_path, serialize):
    members, _ = _run(tmp_path, "members", serialize=serialize)
    joint, grid = _run(tmp_path, "joint", serialize=serialize, cohort_replies=True)
    assert grid.cohort_path.endswith("8 in one reply")
    assert without_wall_time(members) == without_wall_time(joint)  # accuracy, loss, bytes
    assert [r["replies"] for r in joint] == [8, 8] and joint[0]["bytes_up"] > 0


# cohort-safe strategies of sync rounds; those whose hooks are `_plain` answer in one reply
SYNC_STRATEGIES = {
    "fedprox": ("strategy.mu=0.1",),
    "gift": ("local_steps=4",),
    "lrd2d": (),
    "fedsu": (),
    "flower": ("strategy.flower_class=FedProx", "+strategy.kwargs.proximal_mu=0.1"),
}


@pytest.mark.parametrize("strategy", SYNC_STRATEGIES)
def test_every_sync_strategy_runs_the_same_with_one_reply(tmp_path, strategy):
    overrides = (f"strategy={strategy}", *SYNC_STRATEGIES[strategy])
    members, _ = _run(tmp_path, "members", *overrides)
    joint, grid = _run(tmp_path, "joint", *overrides, cohort_replies=True)
    assert grid.cohort_path.startswith("cohort: ")
    assert without_wall_time(members) == without_wall_time(joint)


def test_members_that_miss_the_deadline_are_left_out_as_their_own_replies_would_be(tmp_path):
    slow = ("system=heterogeneous", "loop.deadline_s=1.5", "rounds=2")
    members, _ = _run(tmp_path, "members", *slow)
    joint, grid = _run(tmp_path, "joint", *slow, cohort_replies=True)
    assert grid.cohort_path.endswith("in one reply")
    assert 0 < sum(r["missing"] for r in joint) < 16  # some members landed, some did not
    assert without_wall_time(members) == without_wall_time(joint)


def test_a_member_that_crashes_fails_alone_and_the_round_goes_on(tmp_path, monkeypatch):
    import clients.app

    real = clients.app.prepare_round
    crashed: list[int] = []

    def prepare(msg: Message, context: Any, *memos: Any) -> Any:
        if not crashed:  # the cohort's first member
            crashed.append(msg.metadata.dst_node_id)
            raise RuntimeError("this member's device broke")
        return real(msg, context, *memos)

    monkeypatch.setattr(clients.app, "prepare_round", prepare)
    rows, grid = _run(tmp_path, "crash", "rounds=1", cohort_replies=True)
    assert grid.cohort_path.endswith("7 in one reply")
    assert rows[0]["failed"] == 1 and rows[0]["replies"] == 7 and rows[0]["rejected"] == 0


@pytest.mark.parametrize("strategy", ["fedavg", "fedsu"])  # fedsu: members reply alone
def test_carriers_answer_with_one_cohort_reply_and_the_same_numbers(
    tmp_path, monkeypatch, caplog, strategy
):
    from fl.run.engines import carriers

    sim = ("engine=flower-sim", "engine.cohort=auto", "rounds=2", "progress=false")
    common = (*sim, "plots=false", "num_clients=12", "clients_per_round=9", f"strategy={strategy}")
    with caplog.at_level(logging.INFO, logger=carriers.__name__):
        joint, _ = train_in_process(tmp_path / "joint", *common)
    monkeypatch.setattr(carriers, "takes_cohort_replies", lambda cfg: False)
    members, _ = train_in_process(tmp_path / "members", *common)
    if strategy == "fedavg":
        assert "in one reply" in caplog.text  # each carrier: its members in one reply
    else:
        assert "in one reply" not in caplog.text
    assert without_wall_time(members) == without_wall_time(joint)
    assert [r["replies"] for r in joint] == [9, 9]


def test_a_cohort_reply_naming_a_node_twice_is_dropped_by_the_loop(tmp_path, monkeypatch, caplog):
    import clients.app

    real = clients.app.pack_cohort

    def twice(rows: torch.Tensor, ids: list[int], metrics: Any) -> RecordDict:
        return real(rows, [*ids[:-1], ids[0]], metrics)

    monkeypatch.setattr(clients.app, "pack_cohort", twice)
    with caplog.at_level(logging.WARNING):
        rows, _ = _run(tmp_path, "twice", "rounds=1", cohort_replies=True)
    assert "cohort reply dropped: cohort reply names a node twice" in caplog.text
    assert rows[0]["replies"] == 0 and rows[0]["missing"] == 8
    assert rows[0]["aggregation_skipped"] == 0 and rows[0]["bytes_up"] == 0  # nothing landed


def test_the_engine_asks_for_one_reply_only_where_the_loop_takes_it():
    from fl.common.config import compose
    from fl.run.apps import Apps
    from fl.run.engines.local import _takes_cohort_replies

    apps = Apps.load()
    assert _takes_cohort_replies(compose([]), apps)
    for overrides in (["loop=semi_async"], ["loop.late=carry"], ["privacy=dpsgd"]):
        assert not _takes_cohort_replies(compose(overrides), apps), overrides


# ----- the server's batched checks --------------------------------------------------------
def _strategy(**options: Any) -> tuple[ServerStrategy, list[Message]]:
    strategy = ServerStrategy(FedAvgParams(), seed=0, clients_per_round=NODES, **options)
    strategy.cohort_replies = True  # (as the round loop sets it where cohorts train in process)
    grid = LocalGrid(None, NODES, {})  # type: ignore[arg-type]  # nodes are never called
    sent = list(strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), grid))
    return strategy, sent


def _columns(sent: list[Message], examples: list[int]) -> dict[str, list[Any]]:
    nonces = [m.content["config"][NONCE_KEY] for m in sent]
    return {
        "num-examples": examples,
        "train-loss": [0.5 + i for i in range(len(sent))],
        "samples": [10] * len(sent),
        NONCE_KEY: nonces,
    }


def _rows(n: int) -> torch.Tensor:
    base = LAYOUT.flatten(GLOBAL)
    return torch.stack([base + 0.01 * (i + 1) * torch.arange(LAYOUT.numel) for i in range(n)])


def _joint(sent: list[Message], rows: torch.Tensor, **columns: Any) -> Message:
    ids = [m.metadata.dst_node_id for m in sent]
    metrics = {**_columns(sent, [3, 5, 7, 9, 11][: len(sent)]), **columns}
    return Message(pack_cohort(rows, ids, metrics), reply_to=sent[0])


def _alone(msg: Message, row: torch.Tensor, examples: int, loss: float) -> Message:
    nonce = msg.content["config"][NONCE_KEY]
    metrics = {"num-examples": examples, "train-loss": loss, "samples": 10, NONCE_KEY: nonce}
    content = {**encode_dense(row, LAYOUT), "metrics": MetricRecord(metrics)}
    return Message(RecordDict(content), reply_to=msg)


def test_the_batch_is_checked_and_aggregated_as_the_members_replies_would_be():
    rows = _rows(NODES)
    joint, sent = _strategy()
    new, _ = joint.aggregate_train(1, [_joint(sent, rows)])
    alone, sent_alone = _strategy()
    replies = [
        _alone(m, row, n, 0.5 + i)
        for i, (m, row, n) in enumerate(zip(sent_alone, rows, [3, 5, 7, 9, 11], strict=True))
    ]
    expected, _ = alone.aggregate_train(1, replies)
    assert new is not None and expected is not None
    assert torch.equal(joint.global_vector, alone.global_vector)
    assert joint.stats.accepted == NODES and sorted(joint.stats.delivered) == sorted(
        m.metadata.dst_node_id for m in sent
    )
    assert joint._nonces == {}  # every member's nonce is spent


def test_a_run_whose_engine_makes_no_cohorts_refuses_a_cohort_reply():
    """A deployment's node could otherwise answer for the other nodes it names."""
    from fl.common.config import compose
    from fl.run.engines.carriers import expects_cohort_replies

    assert expects_cohort_replies(compose(["engine.cohort=auto"]))
    assert expects_cohort_replies(compose(["engine=flower-sim", "engine.cohort=auto"]))
    for overrides in ([], ["engine=deployment"], ["engine.cohort=auto", "loop=semi_async"]):
        assert not expects_cohort_replies(compose(overrides)), overrides
    strategy, sent = _strategy()
    strategy.cohort_replies = False
    before = strategy.global_vector.clone()
    new, _ = strategy.aggregate_train(1, [_joint(sent, _rows(NODES))])
    assert new is None and strategy.stats.accepted == 0 and strategy.stats.rejected == 1
    assert strategy.stats.reasons == [
        "cohort reply: this run takes no cohort replies (one node answering for others)"
    ]
    assert torch.equal(strategy.global_vector, before)


def test_the_loop_drops_a_cohort_reply_where_the_run_takes_none(tmp_path, caplog):
    # the grid sends cohort replies; the run's config (engine.cohort=off) expects none
    with caplog.at_level(logging.WARNING):
        rows, _ = train_in_process(
            tmp_path / "off",
            "rounds=1",
            "num_clients=12",
            "clients_per_round=8",
            "progress=false",
            "plots=false",
            grid_class=functools.partial(LocalGrid, cohort=True, cohort_replies=True),
        )
    assert "cohort reply dropped: this run takes no cohort replies" in caplog.text
    assert rows[0]["replies"] == 0 and rows[0]["missing"] == 8 and rows[0]["bytes_up"] == 0


def test_a_nan_row_and_an_oversized_row_are_rejected_alone():
    rows = _rows(NODES)
    rows[1, 3] = math.nan
    rows[3] *= 1e6  # its update's norm is far past max_update_norm
    strategy, sent = _strategy(max_update_norm=100.0)
    before = strategy.global_vector.clone()
    new, _ = strategy.aggregate_train(1, [_joint(sent, rows)])
    assert new is not None and strategy.stats.accepted == 3 and strategy.stats.rejected == 2
    bad = [sent[1].metadata.dst_node_id, sent[3].metadata.dst_node_id]
    assert strategy.stats.reasons[0] == f"node {bad[0]}: update has NaN or Inf values"
    assert strategy.stats.reasons[1].startswith(f"node {bad[1]}: update norm ")
    assert "exceeds max_update_norm 100.0" in strategy.stats.reasons[1]
    weights = torch.tensor([3.0, 7.0, 11.0], dtype=torch.float64)
    good = rows[[0, 2, 4]].double()
    mean = (good * (weights / weights.sum())[:, None]).sum(0).float()
    assert torch.allclose(strategy.global_vector, mean, atol=1e-6)
    assert not torch.equal(strategy.global_vector, before)
    assert strategy._nonces == {}  # spent or, for the rejected, forgotten


def test_a_member_with_a_bad_metric_or_a_replayed_nonce_is_rejected_alone():
    strategy, sent = _strategy()
    columns = _columns(sent, [3, 5, 7, 9, 11])
    columns["train-loss"][0] = math.inf
    columns[NONCE_KEY][2] += 1
    columns["num-examples"][4] = 0
    ids = [m.metadata.dst_node_id for m in sent]
    reply = Message(pack_cohort(_rows(NODES), ids, columns), reply_to=sent[0])
    strategy.aggregate_train(1, [reply])
    assert strategy.stats.accepted == 2 and strategy.stats.rejected == 3
    reasons = " | ".join(strategy.stats.reasons)
    assert "metric 'train-loss' is not finite" in reasons
    assert "answers another instruction" in reasons and "must be a positive int" in reasons


def _malformed(kind: str, sent: list[Message]) -> Message:
    ids = [m.metadata.dst_node_id for m in sent]
    rows, columns = _rows(NODES), _columns(sent, [3, 5, 7, 9, 11])
    if kind == "wrong-n":
        rows = rows[:-1]
        content = pack_cohort(rows, ids[:-1], {k: v[:-1] for k, v in columns.items()})
        content[COHORT] = ConfigRecord({"node-ids": [str(n) for n in ids]})  # one more
    elif kind == "wrong-d":
        content = pack_cohort(rows[:, :-1].contiguous(), ids, columns)
    elif kind == "unknown-id":
        content = pack_cohort(rows, [*ids[:-1], 10**9], columns)
    elif kind == "duplicate-id":
        content = pack_cohort(rows, [*ids[:-1], ids[0]], columns)
    else:  # a metric column one short
        content = pack_cohort(rows, ids, columns)
        content[COHORT_METRICS] = MetricRecord({**columns, "samples": [10] * (NODES - 1)})
    return Message(content, reply_to=sent[0])


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("wrong-n", r"rows are float32 \(4, 16\), expected float32 \(5, 16\)"),
        ("wrong-d", r"expected float32 \(5, 16\)"),
        ("unknown-id", "names node 1000000000, which was not asked"),
        ("duplicate-id", "names a node twice"),
        ("short-column", "metric 'samples' is not a list of 5 values"),
    ],
)
def test_a_malformed_cohort_reply_is_rejected_without_touching_the_model(kind, reason):
    strategy, sent = _strategy()
    before = strategy.global_vector.clone()
    new, metrics = strategy.aggregate_train(1, [_malformed(kind, sent)])
    assert new is None and metrics is None and strategy.stats.accepted == 0
    assert strategy.stats.rejected >= 1
    assert all(re.search(reason, r) for r in strategy.stats.reasons), strategy.stats.reasons
    assert torch.equal(strategy.global_vector, before)


def test_parse_checks_the_reply_against_the_model_and_the_asked_nodes():
    rows = _rows(2)
    content = pack_cohort(rows, [7, 9], {"num-examples": [1, 2]})
    parsed = parse_cohort(content, LAYOUT.numel, {7, 9, 11})
    assert parsed.node_ids == [7, 9] and torch.equal(parsed.rows, rows)
    with pytest.raises(ValueError, match="names 2 nodes, 1 were asked"):
        parse_cohort(content, LAYOUT.numel, {7})
    with pytest.raises(ValueError, match="no 'node-ids' list"):
        parse_cohort(RecordDict({COHORT: ConfigRecord()}), LAYOUT.numel, {7, 9})
    for bad in (["7", "-9"], ["7", "9.0"], ["7", " 9"]):
        content[COHORT] = ConfigRecord({"node-ids": bad})
        with pytest.raises(ValueError, match="not decimal strings"):
            parse_cohort(content, LAYOUT.numel, {7, 9})
    big = 2**64 - 1  # a uint64 node id travels as text
    content = pack_cohort(rows, [big, 9], {"num-examples": [1, 2]})
    assert parse_cohort(content, LAYOUT.numel, {big, 9}).node_ids == [big, 9]


def test_an_extended_record_is_the_record_new_record_makes():
    from fl.wire.records import extended_record, new_record

    shared = new_record(ConfigRecord, {"a": 1, "server-round": 2, "lr": 0.1})
    items = {NONCE_KEY: 7, "lr": 0.5, "speed": [1.0, 2.0]}
    made = extended_record(shared, items)
    expected = ConfigRecord({**shared, **items})
    assert list(made.items()) == list(expected.items()) and type(made) is ConfigRecord
    assert dict(shared) == {"a": 1, "server-round": 2, "lr": 0.1}  # the shared one unchanged
    with pytest.raises(TypeError):
        extended_record(shared, {"bad": object()})
