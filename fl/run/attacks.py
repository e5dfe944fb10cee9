"""Attack injection for robust-FL research: a Flower ClientApp mod that makes clients lie.

Configured next to the faults (`conf/faults/*.yaml`): `faults.attack` names one kind or
several joined by `+`, `faults.attack_rate` the fraction of clients that attack. Which
partitions attack is fixed for the run: `round(attack_rate * num_clients)` of them, drawn
from the run's seed, so an attacked run is as reproducible as a clean one. A selected
attacker trains honestly, then rewrites its reply after `call_next`:

| kind | what the reply then says |
|---|---|
| `inflate_examples` | `num-examples` = `faults.attack_examples` (default 10^12) |
| `sign_flip` | the update reversed and scaled: global - attack_scale x (local - global) |
| `scale` | the update scaled: global + attack_scale x (local - global) |
| `noise` | a random update: global + attack_scale x N(0, 1) per scalar |
| `misreport` | `samples` 0, `epsilon` 0 (if sent), and a codec record declaring 0 bytes |

The update attacks need the global model the client received: the mod decodes it from the
train message and sends a dense reply. That covers every dense push (FedAvg, FedProx, GIFT,
and APF's or PAS's resyncs); a strategy whose client replies in its own encoding (APF's
masked values, PAS's period groups) or which sends a masked pull keeps its honest update,
and the mod says so once per process in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from omegaconf import DictConfig, OmegaConf

from fl.common.config import check_int, check_number, from_run_config, require, run_faults
from fl.common.seeding import derive_seed
from fl.wire.codec import CODEC, CodecError, decode, encode_dense
from fl.wire.records import Layout, record_of, required_record

__all__ = ["ATTACKS", "attack_kinds", "attack_mod", "attackers", "check_attacks", "rewrite_reply"]

log = logging.getLogger(__name__)

ATTACKS = ("inflate_examples", "sign_flip", "scale", "noise", "misreport")
UPDATE_ATTACKS = ("sign_flip", "scale", "noise")
ATTACKER_TAG = 0xBAD  # seeds the choice of attackers; 0xA77 the noise of a round
_warned: set[str] = set()


def attack_kinds(value: Any) -> tuple[str, ...]:
    """The attack kinds of `faults.attack` ('none', null, 'sign_flip+inflate_examples')."""
    if value is None or str(value) in ("", "none"):
        return ()
    return tuple(k.strip() for k in str(value).split("+") if k.strip())


@lru_cache(maxsize=64)
def attackers(seed: int, num_clients: int, rate: float) -> frozenset[int]:
    """The partitions that attack for the whole run: `round(rate * num_clients)` of them."""
    count = min(num_clients, round(rate * num_clients))
    order = np.random.default_rng(derive_seed(seed, ATTACKER_TAG)).permutation(num_clients)
    return frozenset(int(p) for p in order[:count])


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _attacked(kind: str, update: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    if kind == "sign_flip":
        return -scale * update
    if kind == "scale":
        return scale * update
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(update.numel(), generator=generator, dtype=update.dtype)


def rewrite_reply(
    reply: RecordDict,
    kinds: Iterable[str],
    *,
    base: torch.Tensor | None,
    layout: Layout,
    scale: float,
    examples: int,
    seed: int,
) -> list[str]:
    """Apply `kinds` to one reply's content in place; return the kinds applied.

    `base` is the global model the client received (None when it cannot be decoded
    standalone: then the update attacks are skipped). Update attacks go first, so that a
    lie about sizes is told about the payload actually sent.
    """
    kinds = sorted(set(kinds), key=lambda k: (k not in UPDATE_ATTACKS, ATTACKS.index(k)))
    applied = []
    metrics = record_of(reply, "metrics", MetricRecord)
    for kind in kinds:
        if kind in UPDATE_ATTACKS:
            codec = record_of(reply, CODEC, ConfigRecord)
            if base is None or (codec is not None and codec.get("name") != "dense"):
                _warn_once(
                    f"attack {kind!r} needs a dense train message and reply; this strategy "
                    "sends or replies in another encoding, so these updates stay honest"
                )
                continue
            local = decode(reply, layout)
            reply.update(encode_dense(base + _attacked(kind, local - base, scale, seed), layout))
        elif kind == "inflate_examples" and metrics is not None:
            metrics["num-examples"] = int(examples)
        elif kind == "misreport":
            if metrics is not None:
                metrics["samples"] = 0
                if "epsilon" in metrics:
                    metrics["epsilon"] = 0.0
            codec = record_of(reply, CODEC, ConfigRecord)
            if codec is not None:
                reply[CODEC] = ConfigRecord({**codec, "payload-bytes": 0, "control-bytes": 0})
        else:
            continue
        applied.append(kind)
    return applied


def attack_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: the run's attackers rewrite their train replies (none by default)."""
    kinds = attack_kinds(run_faults(context.run_config).get("attack"))
    if not kinds or msg.metadata.message_type != "train":
        return call_next(msg, context)
    cfg = from_run_config(context.run_config)
    faults = cfg.faults
    partition = int(context.node_config["partition-id"])
    rate = float(faults.get("attack_rate", 0.0))
    if partition not in attackers(int(cfg.seed), int(cfg.num_clients), rate):
        return call_next(msg, context)
    from fl.world.task import get_task  # here: the task is built (and cached) by the ClientApp

    layout = get_task(cfg).layout
    base = None
    if any(k in UPDATE_ATTACKS for k in kinds):
        try:
            base = decode(msg.content, layout)  # before training: the content is untouched
        except CodecError:
            base = None
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    config = required_record(msg.content, "config", ConfigRecord)
    server_round = int(config["server-round"])  # type: ignore[arg-type]
    rewrite_reply(
        reply.content,
        kinds,
        base=base,
        layout=layout,
        scale=float(faults.get("attack_scale", 1.0)),
        examples=int(faults.get("attack_examples", 10**12)),
        seed=derive_seed(int(cfg.seed), server_round, partition, 0xA77),
    )
    return reply


def check_attacks(cfg: DictConfig) -> None:
    """`faults.attack` kinds and, when any is set, their rate, scale and claimed examples."""
    kinds = attack_kinds(OmegaConf.select(cfg, "faults.attack"))
    bad = [k for k in kinds if k not in ATTACKS]
    require(not bad, "faults.attack", cfg.faults.get("attack"), f"kinds are {list(ATTACKS)}")
    if kinds:
        check_number(cfg, "faults.attack_rate", 0, 1)
        check_number(cfg, "faults.attack_scale", 0)
        check_int(cfg, "faults.attack_examples", 1)
