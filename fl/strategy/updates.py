"""What the kernel knows of a reply, and what an accepted reply becomes.

The round loop fills `ReplyInfo` (when a reply was asked for and arrived); the strategy's
checks turn a reply into a `ClientUpdate`; `RoundStats` counts what happened to a round's
replies. Strategies read all three; only the kernel writes them. A reply's bounds live
here too: its size (`reply_limit`) and its metrics (`finite_metric`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fl.wire.records import Layout, wire_dtype

__all__ = [
    "PAYLOAD_FACTOR",
    "PAYLOAD_SLACK",
    "ClientUpdate",
    "ReplyInfo",
    "RoundStats",
    "UploadParts",
    "finite_metric",
    "reply_limit",
]

# (fraction of the local samples done before a part of the reply may leave, its bytes)
UploadParts = tuple[tuple[float, int], ...]


@dataclass(frozen=True)
class ReplyInfo:
    """What the loop knows of a reply: when it was asked for and when it arrived."""

    sent_round: int
    staleness: int  # rounds the global model moved on between sending and this round
    arrived_s: float  # virtual seconds since training began
    base: torch.Tensor  # the global vector the instruction carried
    sent_s: float = 0.0  # when its round trip began (virtual: the download's start)
    # the compute span the server observed: the virtual clock's, from the download's end to
    # the training's end (background load included); None on real arrivals, which show
    # the server only the round trip
    compute_s: float | None = None


@dataclass
class ClientUpdate:
    """One accepted reply: the client's full model vector and what it reported.

    A stale reply's vector is already rebased onto the current global model, its step
    scaled by the strategy's staleness weight (`ServerStrategy.rebase`).
    """

    node_id: int
    vector: torch.Tensor
    num_examples: int
    metrics: dict[str, Any]
    staleness: int = 0
    arrived_s: float = 0.0


@dataclass
class RoundStats:
    """What happened to the replies of the last round."""

    sent: list[int] = field(default_factory=list)  # node ids asked to train this round
    delivered: list[int] = field(default_factory=list)  # node ids whose replies landed
    accepted: int = 0
    failed: int = 0  # error replies (crashed ClientApps)
    rejected: int = 0  # replies that failed validation
    missing: list[int] = field(default_factory=list)  # given up on: no reply, dropped, too late
    updates: list[ClientUpdate] = field(default_factory=list)  # the accepted replies
    reasons: list[str] = field(default_factory=list)
    examples_clipped: int = 0  # accepted replies whose num-examples claim was cut to the bound
    norm_clipped: int = 0  # accepted replies scaled down to max_update_norm (policy clip)
    skipped: bool = False  # too few replies for the aggregation rule: global model kept


# Default reply size bound: any of our codecs (dense, masked + bitmap, values + indices,
# control state) stays within 4x the dense model; 1 MiB covers headers and metrics.
PAYLOAD_FACTOR, PAYLOAD_SLACK = 4, 2**20


def finite_metric(value: Any) -> bool:
    """A MetricRecord value (a number or a list of numbers) with no NaN or Inf in it."""
    if isinstance(value, list):
        return all(not isinstance(v, float) or math.isfinite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def reply_limit(layout: Layout) -> int:
    """The default bound on a reply's bytes: PAYLOAD_FACTOR dense models and PAYLOAD_SLACK."""
    sizes, dtypes = layout.sizes, layout.dtypes
    dense = sum(n * wire_dtype(d).itemsize for n, d in zip(sizes, dtypes, strict=True))
    return PAYLOAD_FACTOR * dense + PAYLOAD_SLACK
