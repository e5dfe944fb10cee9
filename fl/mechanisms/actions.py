"""Actions of metric grafting: what a diagnosis may change, applied through existing mechanics.

An action is a setting the server holds and sends; clients apply it through their
`ClientHooks`, the codecs (`fl.wire.codec`) and the sync protocol (`fl.wire.sync`), never through
new plumbing:

| action | setting | how it reaches the client |
| --- | --- | --- |
| `period` | global sync period τ = local steps per round | `local-steps` config key |
| `scalar_period` | per-scalar period τ[x] (PAS) | synced periods; group roll-back; `grouped` |
| `freeze` | freezing mask, AIMD lengths (APF) | synced model + mask; roll-back; `masked` |
| `bits` | upload width 32 / 16 / 8 / 4 / 2 bits | `+f16` / `+q8` / `+q4` / `+q2` value stage |
| `sparsity` | share of the update sent (top-k) | `topk` codec |
| `lr` | learning-rate scale | the `lr` hook |

FedSU's speculation (`fl.mechanisms.speculation.Speculation`: per-scalar anchors, slopes and starts
through `fl.wire.sync`) is an action of the same kind; only FedSU and FedCA+ use it, so it
stays with its mechanics.

Uploads under grafting carry the client's update (model minus the model it was sent),
so quantisation and top-k act on updates, as AdaQuantFL and top-k sparsification do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fl.common.checkpointable import checkpointable
from fl.mechanisms.laws import aimd, divide
from fl.wire.codec import Payload, decode, encode
from fl.wire.masking import Rollback
from fl.wire.records import Layout
from fl.wire.sync import Synced

__all__ = [
    "BIT_WIDTHS",
    "FreezeMask",
    "GlobalSetting",
    "PeriodGroups",
    "bit_width",
    "decode_update",
    "encode_update",
    "freezing_synced",
    "group_sizes",
    "period_upload_parts",
    "periods_synced",
    "shorten_periods",
    "shortest_period",
]

# Upload widths the codecs offer, and the value stage that gives each.
BIT_WIDTHS = {32: "", 16: "+f16", 8: "+q8", 4: "+q4", 2: "+q2"}


@checkpointable
@dataclass
class GlobalSetting:
    """One number the server sends every client: τ, bits, top-k share or lr scale.

    `start` is its value before any diagnosis moved it; `low`/`high` bound it.
    """

    value: float
    start: float
    low: float
    high: float

    @classmethod
    def at(cls, start: float, low: float, high: float) -> GlobalSetting:
        return cls(start, start, low, high)

    def set(self, value: float) -> bool:
        """Move to `value` (clipped); whether it changed."""
        value = min(self.high, max(self.low, value))
        changed = value != self.value
        self.value = value
        return changed


def bit_width(demanded: float) -> int:
    """The narrowest codec width that holds `demanded` bits (2, 4, 8, 16 or 32)."""
    return next(w for w in sorted(BIT_WIDTHS) if demanded <= w or w == max(BIT_WIDTHS))


# ----- freezing (APF) ------------------------------------------------------------------
@checkpointable
@dataclass
class FreezeMask:
    """Per-scalar freezing with AIMD lengths, in check intervals (APF, S-APF-J Alg. 1)."""

    length: torch.Tensor  # L: freezing period, in check intervals
    until: torch.Tensor  # U: check index at which the scalar is active again
    active: torch.Tensor  # M: True where the scalar trains and travels
    checks: int  # c

    @classmethod
    def none_frozen(cls, numel: int) -> FreezeMask:
        return cls(
            torch.zeros(numel, dtype=torch.int64),
            torch.zeros(numel, dtype=torch.int64),
            torch.ones(numel, dtype=torch.bool),
            0,
        )

    def step(self, stable: torch.Tensor) -> None:
        """One check: `stable` (one flag per active scalar) lengthens its period by one
        interval, else halves it; the scalar is frozen for that many intervals."""
        was_active = self.active
        length = aimd(self.length[was_active], stable)
        self.length[was_active] = length
        self.until[was_active] = self.checks + length + 1
        self.checks += 1
        self.active = self.until == self.checks

    def freeze(self, chosen: torch.Tensor, lengths: torch.Tensor) -> None:
        """Freeze the `chosen` scalars for `lengths` more intervals (APF#, APF++)."""
        self.until[chosen] = self.checks + lengths
        self.active = self.until == self.checks


def freezing_synced(lazy: bool) -> tuple[Synced, ...]:
    """Model and mask, kept in step on every client (`fl.wire.sync`); the mask starts all True.
    `lazy`: a returning client gets only the scalars active now (APF's `lazy_frozen`)."""
    return (
        Synced("model", payload=True, within="mask", needed="mask" if lazy else None),
        Synced("mask", dtype=torch.bool, initial=lambda n: torch.ones(n, dtype=torch.bool)),
    )


# ----- per-scalar periods (PAS) --------------------------------------------------------
def shorten_periods(
    periods: torch.Tensor, where: torch.Tensor, ratio: float, floor: int
) -> torch.Tensor:
    """τ[x] ← max(floor, floor(τ[x] / ratio)) for the scalars in `where` (mask or indices),
    in place; returns `periods`."""
    periods[where] = divide(periods[where], ratio, floor)
    return periods


def shortest_period(initial: int, ratio: float, levels: int) -> int:
    """τ_min: τ_0 divided by `ratio` `levels` times, rounded down, at least 1."""
    period = initial
    for _ in range(levels):
        period = max(1, int(period / ratio))
    return period


def periods_synced(initial: int, advance: Callable[[torch.Tensor, torch.Tensor], Any]) -> Synced:
    """The per-scalar periods as synced control state: τ_0 everywhere to start with,
    `advance` (the same shortening rule on both sides) rebuilds them from indices."""
    return Synced(
        "periods",
        dtype=torch.int16,
        initial=lambda n: torch.full((n,), initial, dtype=torch.int64),
        advance=advance,
    )


def group_sizes(periods: torch.Tensor) -> list[tuple[int, int]]:
    """(period, number of scalars) for each distinct period, smallest first."""
    values, counts = torch.unique(periods, sorted=True, return_counts=True)
    return [(int(v), int(c)) for v, c in zip(values, counts, strict=True)]


def period_upload_parts(
    periods: torch.Tensor, up_bytes: int, value_bytes: float = 4
) -> tuple[tuple[float, int], ...]:
    """Each period group leaves as its period ends (`value_bytes` a scalar, from the
    periods the server sent, never the client's own account); any further bytes (scales,
    control state) follow the last group."""
    groups = group_sizes(periods)
    steps = groups[-1][0]
    parts = [(period / steps, int(value_bytes * n)) for period, n in groups]
    extra = max(up_bytes - sum(size for _, size in parts), 0)
    last_fraction, last_bytes = parts[-1]
    return (*parts[:-1], (last_fraction, last_bytes + extra))


class PeriodGroups:
    """Client side of per-scalar periods: after step τ of a group, its scalars are held
    at their values then (rolled back after every later step)."""

    def __init__(self, layout: Layout, periods: torch.Tensor) -> None:
        self.layout, self.periods = layout, periods
        self.boundaries = {p for p, _ in group_sizes(periods)[:-1]}  # all but the last group
        self.rollback: Rollback | None = None

    def after_step(self, step: int, model: nn.Module) -> None:
        if self.rollback is not None:
            self.rollback()
        if step in self.boundaries:  # freeze this group at its current values from now on
            current = self.layout.read(model)
            self.rollback = Rollback(model, self.layout, self.periods > step, current)


# ----- uploads as updates --------------------------------------------------------------
def encode_update(
    delta: torch.Tensor,
    layout: Layout,
    *,
    bits: int = 32,
    fraction: float = 1.0,
    mask: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
) -> Payload:
    """A client's update as it travels: its active scalars (`mask`), its period groups
    (`groups`), or its top `fraction` (< 1), at `bits` per value."""
    stage = BIT_WIDTHS[bits]
    if groups is not None:
        return encode(delta, "grouped" + stage, groups=groups)
    if fraction < 1:
        return encode(delta, "topk" + stage, base=torch.zeros_like(delta), fraction=fraction)
    if mask is not None:  # under a value stage, one array (so one scale) per tensor
        return encode(delta, "masked" + stage, mask=mask, layout=layout if stage else None)
    return encode(delta, "dense" + stage, layout=layout)


def decode_update(
    content: Any,
    layout: Layout,
    *,
    mask: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """The update a reply carries (0 where nothing was sent), whatever codec it chose."""
    return decode(content, layout, base=torch.zeros(layout.numel), mask=mask, groups=groups)
