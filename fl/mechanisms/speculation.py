"""Speculative updating: move predictable scalars along their last slope on both sides.

FedSU (Yu et al., ICDCS 2025; spec algorithms_a.md §5) and FedCA+'s speculative
sparsification (§6.8) share these mechanics:

- whether a scalar's global trajectory is a straight line is a diagnosis,
  `fl.mechanisms.diagnosis.LinearityTest` (FedSU eq. 1-2: APF's effective-perturbation
  EMA applied to second differences of the round updates);
- `Speculation`: per-scalar state every party holds identically (which scalars are
  speculated, their anchor value, slope and start), and the closed form of their value
  at any clock tick, so a client that skipped rounds computes the same bits.
- `checks_due` / `error_ratio`: when the no-check period of a speculated scalar ends
  (after 1, 2, 3, ... ticks: FedSU's additive growth) and the test S = |ē| / |s| that
  sends it back to regular synchronisation; `error_feedback` is the control law that
  combines them.
- `ErrorFeedback`: a client's accumulated mis-prediction per speculated scalar, kept in
  its `Context.state`; it reports the mean error per round it took part in.

The clock counts aggregations (not server rounds): a round that aggregates nothing
leaves every speculated value where it was, on the server and on the clients alike.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from fl.common.checkpointable import checkpointable
from fl.wire.records import array_to_numpy, numpy_to_array

__all__ = [
    "ErrorFeedback",
    "Speculation",
    "checks_due",
    "digest",
    "error_feedback",
    "error_ratio",
    "phase_error",
    "window_start",
]


@checkpointable
@dataclass
class Speculation:
    """Which scalars are speculated, and from where: identical on every party.

    A scalar speculated since tick `since` with slope s and anchor a has the value
    a + (t - since) * s at tick t. Two IEEE operations (a multiply, then an add; never a
    fused multiply-add), elementwise, so every machine computes the same bits from the
    same state. Where a scalar is not speculated its anchor is its current value.
    """

    anchor: torch.Tensor  # float32
    speculating: torch.Tensor  # bool
    slope: torch.Tensor  # float32
    since: torch.Tensor  # int64: the tick at which the scalar's value was its anchor

    @classmethod
    def fresh(cls, vector: torch.Tensor) -> Speculation:
        """Nothing speculated; the anchor is `vector`."""
        n = vector.numel()
        return cls(
            vector.detach().clone().float(),
            torch.zeros(n, dtype=torch.bool),
            torch.zeros(n),
            torch.zeros(n, dtype=torch.int64),
        )

    def values(self, tick: int) -> torch.Tensor:
        """The model at `tick`: anchors, moved along their slopes where speculated."""
        steps = (tick - self.since).to(self.slope.dtype)
        moved = self.anchor + steps * self.slope
        return torch.where(self.speculating, moved, self.anchor)

    def start(
        self, where: torch.Tensor, vector: torch.Tensor, slope: torch.Tensor, tick: int
    ) -> None:
        """Speculate the scalars in `where` from `vector` (their value at `tick`) on."""
        self.anchor[where] = vector[where]
        self.slope[where] = slope[where]
        self.since[where] = tick
        self.speculating |= where

    def stop(self, where: torch.Tensor, vector: torch.Tensor) -> None:
        """Return the scalars in `where` to regular sync at their value in `vector`."""
        self.anchor[where] = vector[where]
        self.speculating &= ~where

    def track(self, vector: torch.Tensor) -> None:
        """Regular scalars' anchors follow the synchronised model."""
        regular = ~self.speculating
        self.anchor[regular] = vector[regular]


def _triangular(m: torch.Tensor) -> torch.Tensor:
    """Whether each m >= 1 is 1, 3, 6, 10, ... (j(j+1)/2 for some j >= 1)."""
    j = torch.round((torch.sqrt(8 * m.double() + 1) - 1) / 2).to(torch.int64)
    return (m >= 1) & (j * (j + 1) // 2 == m)


def checks_due(spec: Speculation, tick: int) -> torch.Tensor:
    """Speculated scalars whose no-check period ends with the aggregation at `tick`.

    Periods grow by one each time a check passes (1, 2, 3, ... ticks), so checks fall
    where the ticks elapsed at the end of the aggregation, tick + 1 - since, are
    triangular. Both sides derive it; nothing travels.
    """
    return spec.speculating & _triangular(tick + 1 - spec.since)


def window_start(spec: Speculation, tick: int, reset: bool) -> torch.Tensor:
    """The tick from which errors count at the aggregation at `tick`: the phase's start
    (`since`), or with `reset` the end of the last check the phase passed.

    Checks fall at triangular elapsed ticks (1, 3, 6, ...), so the last check before the
    aggregation ending at elapsed e is the largest triangular number below e, derived on
    both sides; nothing travels.
    """
    if not reset:
        return spec.since.clone()
    before = (tick - spec.since).clamp_min(0)  # elapsed ticks before this aggregation
    j = torch.floor((torch.sqrt(8 * before.double() + 1) - 1) / 2).to(torch.int64)
    j -= (j * (j + 1) // 2 > before).to(torch.int64)  # guards against float rounding
    j += ((j + 1) * (j + 2) // 2 <= before).to(torch.int64)
    return spec.since + j * (j + 1) // 2


def phase_error(
    per_round: torch.Tensor,
    weights: torch.Tensor,
    spec: Speculation,
    tick: int,
    reset: bool = False,
) -> torch.Tensor:
    """The global error accumulated over each scalar's speculation phase, ē (with
    `reset`: since the last check it passed, `window_start`).

    `per_round` is (clients, scalars): each client's mean error per round it took part
    in (`ErrorFeedback.mean`); `weights` their aggregation weights. With full
    participation this is the weighted mean of the clients' accumulated errors (FedSU's
    ē); with partial participation it scales the mean per-round error by the window's
    length, so clients that joined fewer rounds weigh the same (spec §5.3 proposal).
    """
    w = weights.to(torch.float64) / weights.to(torch.float64).sum()
    mean = (w[:, None] * per_round.to(torch.float64)).sum(0)
    length = tick + 1 - window_start(spec, tick, reset)
    return (mean * length.to(torch.float64)).float()


def error_ratio(error: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    """S = |ē| / |s| per scalar; 0 where both are 0 (a perfect zero slope), inf where
    only the slope is."""
    size = slope.abs()
    ratio = error.abs() / size.clamp_min(torch.finfo(size.dtype).tiny)
    return torch.where(size > 0, ratio, torch.where(error == 0, 0.0, torch.inf))


def error_feedback(
    spec: Speculation, tick: int, error: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedSU's control law for leaving speculation, at the aggregation at `tick`.

    Returns the scalars checked now (`checks_due`) and, of those, the ones sent back to
    regular sync because their phase error ē reached `threshold` slopes (S >= T_S); the
    others pass, and their next no-check period is one tick longer.
    """
    due = checks_due(spec, tick)
    return due, due & (error_ratio(error, spec.slope) >= threshold)


class ErrorFeedback:
    """A client's mis-prediction per speculated scalar, for the window it started in.

    `error` sums x_local_end - (x_prev + s) over the rounds this client trained in the
    window, `rounds` counts them, and `phase` remembers which window (its start tick,
    `window_start`: the phase's start, or the last passed check with `reset`): a scalar
    whose window changed since this client last took part starts from zero.
    """

    KEY = "speculation-errors"

    def __init__(self, error: torch.Tensor, rounds: torch.Tensor, phase: torch.Tensor) -> None:
        self.error, self.rounds, self.phase = error, rounds, phase

    @classmethod
    def load(
        cls, state: RecordDict, spec: Speculation, tick: int = 0, reset: bool = False
    ) -> ErrorFeedback:
        """The accumulator kept in `state` for the round trained at `tick`, reset wherever
        a new window started (a new phase; with `reset` also a passed check)."""
        n = spec.anchor.numel()
        start = window_start(spec, tick, reset)
        record = state.array_records.get(cls.KEY)
        if record is None or array_to_numpy(record["error"]).size != n:
            out = cls(torch.zeros(n), torch.zeros(n, dtype=torch.int64), start.clone())
        else:
            out = cls(*(torch.from_numpy(array_to_numpy(record[k]).copy()) for k in _PARTS))
        stale = ~spec.speculating | (out.phase != start)
        out.error[stale], out.rounds[stale] = 0.0, 0
        out.phase = start.clone()
        return out

    def add(self, where: torch.Tensor, error: torch.Tensor) -> None:
        """Add one round's error of the scalars in `where`."""
        self.error[where] += error[where]
        self.rounds[where] += 1

    def mean(self) -> torch.Tensor:
        """Mean error per round taken part in (0 where none)."""
        return self.error / self.rounds.clamp_min(1).to(self.error.dtype)

    def save(self, state: RecordDict) -> None:
        """Keep the accumulator in the node's persistent state."""
        arrays = {"error": self.error, "rounds": self.rounds, "phase": self.phase}
        state[self.KEY] = ArrayRecord({k: numpy_to_array(arrays[k].numpy()) for k in _PARTS})


_PARTS = ("error", "rounds", "phase")


def digest(vector: torch.Tensor) -> int:
    """CRC-32 of a float32 vector's bytes: a client reports the one of the model it
    trained from, so the server can check that speculated values agree bit for bit."""
    return zlib.crc32(np.ascontiguousarray(vector.detach().float().cpu().numpy()).tobytes())
