"""Injected attacks: who attacks (fixed per run, by seed), and what each kind does to a reply."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fl.common.config import compose, to_run_config
from fl.run.attacks import attack_kinds, attackers, rewrite_reply
from fl.run.engines.local import LocalGrid
from fl.run.faults import InjectedCrash, fault_mod
from fl.wire.codec import decode, encode_dense, encode_masked
from fl.wire.records import Layout
from fl.world.task import get_task

LAYOUT = Layout.of({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
BASE = torch.arange(9, dtype=torch.float32)
LOCAL = BASE + 0.5  # the honest update: +0.5 everywhere


def _reply(vector: torch.Tensor = LOCAL, **metrics) -> RecordDict:
    values = {"num-examples": 40, "train-loss": 0.3, "samples": 80, **metrics}
    return RecordDict({**encode_dense(vector, LAYOUT), "metrics": MetricRecord(values)})


def _rewrite(reply: RecordDict, kinds: str, base=BASE, scale: float = 3.0) -> list[str]:
    return rewrite_reply(
        reply,
        attack_kinds(kinds),
        base=base,
        layout=LAYOUT,
        scale=scale,
        examples=10**12,
        seed=7,
    )


def test_attackers_are_a_fixed_share_of_the_partitions_drawn_from_the_seed():
    chosen = attackers(0, 20, 0.2)
    assert len(chosen) == 4 and chosen <= set(range(20))
    assert attackers(0, 20, 0.2) == chosen  # the same every round and every process
    assert attackers(1, 20, 0.2) != chosen
    assert attackers(0, 20, 0.0) == frozenset() and len(attackers(0, 20, 1.0)) == 20
    assert attackers(0, 20, 0.3) >= chosen  # a higher rate adds attackers, keeps these


def test_attack_kinds_combine_with_plus():
    assert attack_kinds("none") == attack_kinds(None) == ()
    assert attack_kinds("sign_flip+inflate_examples") == ("sign_flip", "inflate_examples")


def test_inflate_examples_claims_the_configured_count_and_keeps_the_update():
    reply = _reply()
    assert _rewrite(reply, "inflate_examples") == ["inflate_examples"]
    assert reply.metric_records["metrics"]["num-examples"] == 10**12
    assert torch.equal(decode(reply, LAYOUT), LOCAL)


@pytest.mark.parametrize(
    ("kind", "update"),
    [("sign_flip", -1.5), ("scale", 1.5)],  # attack_scale 3 x the honest +0.5
)
def test_sign_flip_and_scale_rewrite_the_update_around_the_received_model(kind, update):
    reply = _reply()
    assert _rewrite(reply, kind) == [kind]
    assert torch.allclose(decode(reply, LAYOUT), BASE + update)
    assert reply.metric_records["metrics"]["num-examples"] == 40


def test_noise_replaces_the_update_with_seeded_gaussian_noise():
    first, again = _reply(), _reply()
    _rewrite(first, "noise", scale=2.0)
    _rewrite(again, "noise", scale=2.0)
    noise = decode(first, LAYOUT) - BASE
    assert torch.equal(noise, decode(again, LAYOUT) - BASE)  # reproducible
    assert not torch.allclose(noise, torch.full((9,), 0.5))
    assert 0.5 < float(noise.std()) < 4


def test_misreport_claims_no_work_no_privacy_loss_and_no_bytes():
    reply = _reply(epsilon=2.5)
    _rewrite(reply, "misreport")
    metrics = reply.metric_records["metrics"]
    assert metrics["samples"] == 0 and metrics["epsilon"] == 0.0
    codec = reply.config_records["codec"]
    assert codec["payload-bytes"] == 0 and codec["control-bytes"] == 0
    assert torch.equal(decode(reply, LAYOUT), LOCAL)


def test_combined_attacks_apply_update_attacks_first():
    reply = _reply()
    applied = _rewrite(reply, "misreport+sign_flip+inflate_examples")
    assert applied == ["sign_flip", "inflate_examples", "misreport"]
    assert torch.allclose(decode(reply, LAYOUT), BASE - 1.5)
    assert reply.config_records["codec"]["payload-bytes"] == 0  # the lie survives re-encoding


def test_update_attacks_leave_other_encodings_honest_and_say_so(caplog):
    mask = torch.tensor([True, False] * 4 + [True])
    masked = RecordDict(
        {
            **encode_masked(LOCAL, mask, ship_mask=True),
            "metrics": MetricRecord({"num-examples": 40}),
        }
    )
    with caplog.at_level(logging.WARNING, logger="fl.run.attacks"):
        assert _rewrite(masked, "sign_flip+inflate_examples") == ["inflate_examples"]
        assert _rewrite(_reply(), "scale", base=None) == []
    assert "stay honest" in caplog.text
    assert torch.equal(decode(masked, LAYOUT, base=BASE), torch.where(mask, LOCAL, BASE))


def _context(cfg, partition: int) -> Context:
    return Context(
        run_id=1,
        node_id=100 + partition,
        node_config={"partition-id": partition, "num-partitions": cfg.num_clients},
        state=RecordDict(),
        run_config=to_run_config(cfg),
    )


def test_the_client_mod_rewrites_only_the_attackers_train_replies():
    cfg = compose(["faults=sign_flip", "faults.attack=sign_flip+inflate_examples"])
    layout = get_task(cfg).layout
    base = torch.zeros(layout.numel)
    LocalGrid(None, 1, {})  # type: ignore[arg-type]  # sets Flower's task identity
    chosen = attackers(cfg.seed, cfg.num_clients, 0.2)
    seen = {}
    for partition in range(cfg.num_clients):
        content = RecordDict(
            {**encode_dense(base, layout), "config": ConfigRecord({"server-round": 3})}
        )
        msg = Message(content, 100 + partition, "train")

        def honest(msg: Message, context: Context) -> Message:
            metrics = MetricRecord({"num-examples": 50, "samples": 100})
            records = {**encode_dense(base + 1, layout), "metrics": metrics}
            return Message(RecordDict(records), reply_to=msg)

        reply = fault_mod(msg, _context(cfg, partition), honest)
        claimed = reply.content.metric_records["metrics"]["num-examples"]
        seen[partition] = (claimed, float(decode(reply.content, layout)[0]))
    assert {p for p, (claimed, _) in seen.items() if claimed == 10**12} == chosen
    assert {p for p, (_, value) in seen.items() if value == -10.0} == chosen
    assert all(seen[p] == (50, 1.0) for p in range(cfg.num_clients) if p not in chosen)


def test_a_client_that_crashes_never_attacks():
    cfg = compose(["faults=sign_flip", "faults.crash=1.0"])
    attacker = min(attackers(cfg.seed, cfg.num_clients, 0.2))
    LocalGrid(None, 1, {})  # type: ignore[arg-type]
    content = RecordDict({"config": ConfigRecord({"server-round": 1})})
    with pytest.raises(InjectedCrash):
        fault_mod(Message(content, 1, "train"), _context(cfg, attacker), lambda m, c: m)
