"""Round-robin group schedule (R2SP, INFOCOM 2019 §III; spec algorithms_b.md §2.2).

Groups of clients take turns in a fixed cyclic order, and consecutive starts are spaced
by a gap of r·T/G: T is the span of one group's iteration (pull, compute, push), G the
number of groups, r ≤ 1 a relaxation so that a group finishing a little early is not
blocked for long. On the first cycle the groups therefore start at offsets 0, r·T/G,
2·r·T/G, ... and their pushes reach the shared server link one after another instead of
all at once. T is an exponential moving average of the spans observed, seeded with the
span the loop predicts for the first group with the server link to itself.

The loop (`fl.run.loops`, `loop=groups`) asks the schedule which idle groups may start
(`due`), when each starts (`release`), and reports when a group has landed (`landed`);
a strategy (R2SP, FL-R2SP) owns it and reads `groups` and `period_s`.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RoundRobin"]


@dataclass
class RoundRobin:
    """Whose turn it is, when the last group started, and the estimate of T."""

    relaxation: float = 0.8  # r: the enforced gap is r·T/G (paper's default 0.8)
    ema: float = 0.9  # weight of the old T in the moving average (FL prototype: 0.9)
    groups: int = 0  # G: set by the loop (`bind`)
    period_s: float | None = None  # T; None until the first group starts
    turn: int = 0  # the group that starts next
    last_release_s: float = -math.inf
    released_s: dict[int, float] = field(default_factory=dict)  # group -> its latest start

    def bind(self, groups: int) -> None:
        """The loop's number of groups."""
        if groups < 1:
            raise ValueError(f"a round-robin schedule needs at least one group, got {groups}")
        self.groups = groups

    @property
    def gap_s(self) -> float:
        """The least time between two consecutive starts, r·T/G (0 before T is known)."""
        if self.period_s is None:
            return 0.0
        return self.relaxation * self.period_s / self.groups

    def due(self, idle: Collection[int], busy: Collection[int]) -> list[int]:
        """The groups that may start now, in turn order.

        From the group whose turn it is, each idle group in cyclic order, up to the first
        one still in flight (it keeps its turn). A group neither idle nor in flight (none
        of its members reachable) passes its turn, so that it cannot stall the others.
        """
        out: list[int] = []
        for step in range(self.groups):
            group = (self.turn + step) % self.groups
            if group in busy:
                break
            if group in idle:
                out.append(group)
        return out

    def release(self, group: int, now: float, span_s: float) -> float:
        """When `group` starts: now, or the last start plus the gap if that is later.

        `span_s`: the loop's prediction of the group's span, which seeds T once.
        """
        if self.period_s is None:
            self.period_s = span_s
        start = max(now, self.last_release_s + self.gap_s)
        self.last_release_s = start
        self.released_s[group] = start
        self.turn = (group + 1) % self.groups
        return start

    def landed(self, group: int, arrived_s: float) -> None:
        """`group`'s last reply arrived at `arrived_s`: one more observation of T."""
        observed = arrived_s - self.released_s[group]
        old = observed if self.period_s is None else self.period_s
        self.period_s = self.ema * old + (1 - self.ema) * observed

    def state_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return {
            "period_s": self.period_s,
            "turn": self.turn,
            "last_release_s": self.last_release_s,
            "released_s": dict(self.released_s),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what `state_dict` returned."""
        self.period_s = state["period_s"]
        self.turn = int(state["turn"])
        self.last_release_s = float(state["last_release_s"])
        self.released_s = {int(g): float(t) for g, t in state["released_s"].items()}
