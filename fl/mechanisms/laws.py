"""Control laws of metric grafting: how a diagnosis value moves an action's setting.

Small, named and pure, so that a scheme reads as diagnosis + action + law and any
diagnosis can drive any action (`strategies/graft.py`):

- `below`: the threshold test (APF: a scalar is stable when its stepping rate < T_s;
  FedSU: it is linear, and speculated, when its oscillation ratio R < T_R).
- `aimd`: additive increase, multiplicative decrease of a per-element length (APF's
  freezing periods: +1 when stable, halved when not).
- `divide`: multiplicative decrease with rounding and a floor (GIFT's τ ← ceil(τ / ρ),
  PAS's τ[x] ← floor(τ[x] / γ)); the stall that triggers it is
  `fl.mechanisms.diagnosis.PlateauDetector` ("no new low for W rounds").
- `ratio_law`: a setting proportional to a power of the metric's ratio to its first
  value (AdaComm τ_k = ceil(sqrt(F_k / F_0) τ_0); AdaQuantFL's levels grow as
  sqrt(F_0 / F_k)).
- `gap_ratio`: any diagnosis in the loss ratio's units: its remaining distance to the
  value where its original calls training settled, over its first distance (the loss
  ratio F_k / F_0 is this with F settled at 0), so a grafted diagnosis that reaches its
  settled value drives the law to the end of its range, as a loss that reaches 0 would.
"""

from __future__ import annotations

import math

import torch

__all__ = ["aimd", "below", "divide", "divide_int", "gap_ratio", "ratio_law"]


def below(values: torch.Tensor, threshold: float) -> torch.Tensor:
    """Where `values` are under `threshold` (strictly)."""
    return values < threshold


def aimd(lengths: torch.Tensor, grow: torch.Tensor) -> torch.Tensor:
    """Lengths + 1 where `grow`, else halved (integer division): APF's freezing periods."""
    return torch.where(grow, lengths + 1, lengths // 2)


def divide(
    values: torch.Tensor, ratio: float, floor: int, *, round_up: bool = False
) -> torch.Tensor:
    """max(floor, round(values / ratio)), rounded down (PAS) or up (GIFT), same dtype."""
    quotient = values / ratio
    rounded = torch.ceil(quotient) if round_up else torch.floor(quotient)
    return rounded.to(values.dtype).clamp_min(floor)


def divide_int(value: int, ratio: float, floor: int, *, round_up: bool = False) -> int:
    """`divide` of one Python int, in float64 as GIFT's τ always was."""
    quotient = value / ratio
    return max(floor, math.ceil(quotient) if round_up else math.floor(quotient))


def gap_ratio(value: float, first: float, settled: float) -> float:
    """(value - settled) / (first - settled): 1 at the start, 0 once settled (0 when the
    first value was settled already)."""
    gap = first - settled
    return (value - settled) / gap if gap > 0 else 0.0


def ratio_law(
    relative: float, start: float, exponent: float, low: float, high: float, *, whole: bool = True
) -> float:
    """relative ** exponent * start, rounded up to a whole number (unless not `whole`),
    clipped to [low, high].

    `relative` is the loss ratio, or a grafted diagnosis's `gap_ratio` (1 in the first
    round, 0 once settled: then the law gives the end of its range).
    """
    if not relative > 0 or not math.isfinite(relative):
        return float(high if exponent < 0 else low)
    value = relative**exponent * start
    return float(min(high, max(low, math.ceil(value) if whole else value)))
