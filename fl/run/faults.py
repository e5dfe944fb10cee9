"""Fault injection for clients: crashes, dropouts and hangs, as a Flower ClientApp mod.

Which selected client fails, and how, is drawn from (seed, round, partition), so a faulty
run is as reproducible as a clean one. A crash raises (the node sends an error reply); a
dropout sends nothing; a hang replies after the round's deadline. On the local engine
time is virtual, so a hang costs no real time: the reply is simply missing from the
round, and the clock charges the deadline the server waited for. On real engines a hang
really stalls the ClientApp for `faults.hang_s` seconds.

Clients that lie rather than fail (inflated example counts, reversed or noisy updates,
misreported samples, ε or sizes) are `fl.run.attacks.attack_mod`, configured by the same
`faults` group (`faults.attack`, `faults.attack_rate`); `fault_mod` runs it inside itself,
so a client that crashes or drops out never gets to attack.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable
from omegaconf import DictConfig

from fl.common.config import check_number, from_run_config, is_finite, require, run_faults
from fl.common.seeding import derive_seed
from fl.run.attacks import attack_kinds, attack_mod
from fl.wire.records import required_record

__all__ = [
    "InjectedCrash",
    "NoReply",
    "check_faults",
    "draw_fault",
    "fault_mod",
    "group_injects",
    "injects_faults",
]

KINDS = ("crash", "dropout", "hang")


class NoReply(Exception):
    """Raised inside a ClientApp to model a reply that never arrives in time."""


class InjectedCrash(RuntimeError):
    """An injected client crash."""


def draw_fault(seed: int, server_round: int, partition: int, rates: dict[str, float]) -> str:
    """'crash', 'dropout', 'hang' or '' for this client in this round."""
    u = np.random.default_rng(derive_seed(seed, server_round, partition, 0xFA17)).random()
    edge = 0.0
    for kind in KINDS:
        edge += rates.get(kind, 0.0)
        if u < edge:
            return kind
    return ""


def injects_faults(run_config: dict[str, object]) -> bool:
    """Whether the run injects faults or attacks (then every message must pass the mod)."""
    return group_injects(run_faults(run_config))


def group_injects(faults: Mapping[str, Any]) -> bool:
    """Whether a `faults` group (as a plain dict) injects faults or attacks."""
    return any(float(faults.get(kind, 0.0)) for kind in KINDS) or bool(
        attack_kinds(faults.get("attack"))
    )


def fault_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: inject the configured faults (then attacks) into train messages."""
    if msg.metadata.message_type != "train":
        return call_next(msg, context)
    if "partition-id" not in context.node_config:  # the ClientApp says what is missing
        return call_next(msg, context)
    faults = run_faults(context.run_config)
    if not any(float(faults.get(kind, 0.0)) for kind in KINDS):  # no client fails: none drawn
        return attack_mod(msg, context, call_next)
    cfg = from_run_config(context.run_config)
    server_round = int(required_record(msg.content, "config", ConfigRecord)["server-round"])  # type: ignore[arg-type]
    partition = int(context.node_config["partition-id"])
    kind = draw_fault(cfg.seed, server_round, partition, faults)
    if kind == "crash":
        raise InjectedCrash(f"injected crash (round {server_round}, partition {partition})")
    if kind == "dropout" or (kind == "hang" and cfg.engine.name == "local"):
        raise NoReply(kind)
    if kind == "hang":
        time.sleep(float(faults["hang_s"]))
    return attack_mod(msg, context, call_next)


def check_faults(cfg: DictConfig) -> None:
    """Injected fault rates: each in [0, 1], together at most 1; a hang's length."""
    rates = [cfg.faults[kind] for kind in ("crash", "dropout", "hang")]
    require(
        all(is_finite(r) and 0 <= r <= 1 for r in rates) and sum(rates) <= 1,
        "faults",
        rates,
        "crash, dropout and hang rates must be in [0, 1] and sum to at most 1",
    )
    check_number(cfg, "faults.hang_s", 0)
