"""Which strategy, and which version of its message contract, a train instruction is for.

The server half and the client half of a strategy agree on a wire format (APF's masked
payloads, PAS's periods); a ClientApp configured with another strategy would misread the
instruction, train, and reply with something the server cannot decode, round after
round. So every instruction from our loop names its strategy and the contract version; a
ClientApp whose half differs replies with a `CONTRACT_MISMATCH` error naming both sides,
and the server stops the run with that error (`fl.common.errors.RunError`, a non-zero exit).
An instruction without these keys (a stock Flower ServerApp) is accepted as it is; if its
payload then turns out unreadable by this client half, the error says which strategy the
client runs and what the server sent (`unreadable`), since mismatched halves are the
likely cause.

Each instruction also carries a nonce (`NONCE_KEY`) that our ClientApps echo in their
reply's metrics (`echo`): the kernel accepts a reply only as the answer to the
instruction whose nonce it echoes, so a reply from an earlier round or another
instruction is refused whatever the strategy. A reply with no echo (a stock Flower
ClientApp) is taken as the answer it says it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Error, Message, RecordDict

from fl.common.errors import RunError
from fl.common.text import shown
from fl.wire.codec import CODEC
from fl.wire.sync import SYNC

__all__ = [
    "CONTRACT_MISMATCH",
    "CONTRACT_VERSION",
    "NONCE_KEY",
    "ContractMismatch",
    "check_reply_error",
    "echo",
    "mismatch_reply",
    "stamp",
    "unreadable",
]

# Bump when the train instruction/reply format between the halves changes incompatibly.
CONTRACT_VERSION = 1
CONTRACT_MISMATCH = 100  # an error code outside Flower's own (flwr.common.constant.ErrorCode)
STRATEGY_KEY, VERSION_KEY = "fl-strategy", "fl-contract"
NONCE_KEY = "fl-nonce"  # in an instruction's config and, echoed, in its reply's metrics


class ContractMismatch(RunError):
    """A ClientApp runs another strategy, or another contract version, than the server."""


def stamp(strategy: str) -> dict[str, Any]:
    """Config keys naming the server's strategy and contract version."""
    return {STRATEGY_KEY: strategy, VERSION_KEY: CONTRACT_VERSION}


def echo(config: Mapping[str, Any]) -> dict[str, Any]:
    """The reply metrics that name the instruction (its nonce), if it carried one."""
    return {NONCE_KEY: config[NONCE_KEY]} if NONCE_KEY in config else {}


def mismatch_reply(message: Message, config: Mapping[str, Any], strategy: str) -> Message | None:
    """An error reply when `message` (its train `config`) is not for this client's half."""
    theirs = (config.get(STRATEGY_KEY, strategy), config.get(VERSION_KEY, CONTRACT_VERSION))
    if theirs == (strategy, CONTRACT_VERSION):
        return None
    reason = (
        f"contract mismatch: the server sends strategy={theirs[0]} (contract {theirs[1]}), "
        f"this ClientApp runs strategy={strategy} (contract {CONTRACT_VERSION})"
    )
    return Message(Error(CONTRACT_MISMATCH, reason), reply_to=message)


def check_reply_error(reply: Message) -> None:
    """Raise `ContractMismatch` for a reply that says its ClientApp runs another half."""
    if reply.has_error() and reply.error.code == CONTRACT_MISMATCH:
        node = reply.metadata.src_node_id
        raise ContractMismatch(f"node {node}: {shown(reply.error.reason)}; the run is stopped")


def unreadable(
    err: Exception, content: RecordDict, config: Mapping[str, Any], strategy: str
) -> str:
    """Why this ClientApp (running `strategy`) cannot read an instruction's payload: `err`,
    and, for an instruction that names no strategy, the likely cause (another server half)."""
    if STRATEGY_KEY in config:  # stamped, and the same strategy (else refused before)
        return f"{err} (strategy={strategy}, contract {CONTRACT_VERSION})"
    codec = content.get(CODEC)
    kind = str(codec.get("name", "dense")) if isinstance(codec, ConfigRecord) else "dense"
    synced = " with synced client state" if SYNC in content else ""
    return (
        f"{err}: the server sent a {kind!r} payload{synced} that this ClientApp's half of "
        f"strategy={strategy} cannot read; its instruction names no strategy ({STRATEGY_KEY}), "
        "so its server half probably runs another strategy: run both halves with the same "
        "strategy (our ServerStrategy stamps its name; docs/STRATEGIES.md, contract version)"
    )
