"""Traces: how a device's speed and availability vary with virtual time.

Seeded background load per client (`SpeedTrace`), seeded on/off slowdowns
(`ToggleTrace`) and availability windows, seeded or read from a trace file
(`AvailabilityTrace`). Each is piecewise constant, so the clock's event times stay exact.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fl.common.config import is_finite
from fl.common.files import read_regular_text

__all__ = ["AvailabilityTrace", "SpeedTrace", "ToggleTrace"]


def _periods(t: float, length: float) -> int:
    """The largest k with k*length <= t, so a boundary computed as k*length is exact."""
    k = math.floor(t / length)
    if (k + 1) * length <= t:
        return k + 1
    return k - 1 if k * length > t else k


class SpeedTrace:
    """Seeded AR(1) background load per client, constant over slots of `slot_s` seconds.

    `load_t = rho*load_{t-1} + (1-rho)*mean + sigma*eps`, clipped to [0, 0.95]; the device
    trains at `1 - load` of its speed, as a non-dedicated machine does (spec §0.3).
    """

    _BLOCK = 16  # slots drawn at once: a slot's load never depends on the order of requests

    def __init__(
        self,
        seed: int,
        *,
        slot_s: float = 60.0,
        mean: float = 0.3,
        rho: float = 0.9,
        sigma: float = 0.1,
    ) -> None:
        if not (is_finite(slot_s) and slot_s > 0):
            raise ValueError(f"speed trace: slot_s must be a positive number, got {slot_s!r}")
        for name, value, high in (("mean", mean, 0.95), ("rho", rho, 1.0), ("sigma", sigma, None)):
            if not (is_finite(value) and value >= 0 and (high is None or value <= high)):
                bounds = f"[0, {high}]" if high is not None else ">= 0"
                raise ValueError(f"speed trace: {name} must be in {bounds}, got {value!r}")
        self.seed, self.slot_s = seed, float(slot_s)
        self.mean, self.rho, self.sigma = float(mean), float(rho), float(sigma)
        self._loads: dict[int, list[float]] = {}
        self._rngs: dict[int, np.random.Generator] = {}

    def multiplier(self, partition: int, t: float) -> float:
        """Fraction of its full speed that `partition` has at virtual time `t`."""
        slot = _periods(t, self.slot_s)
        if slot < 0:
            raise ValueError(f"speed trace: negative time {t}")
        loads = self._loads.setdefault(partition, [])
        while len(loads) <= slot:
            self._draw(partition, loads)
        return 1.0 - loads[slot]

    def next_change(self, t: float) -> float:
        """The first slot boundary after `t`."""
        return (_periods(t, self.slot_s) + 1) * self.slot_s

    def next_change_of(self, partition: int, t: float) -> float:
        """The first time after `t` at which `partition`'s speed may change."""
        return self.next_change(t)

    def _draw(self, partition: int, loads: list[float]) -> None:
        """Extend `partition`'s loads by one block of slots from its own generator."""
        if partition not in self._rngs:
            self._rngs[partition] = np.random.default_rng([self.seed, partition, 0x5EED])
        load = loads[-1] if loads else self.mean
        for eps in self._rngs[partition].standard_normal(self._BLOCK).tolist():
            load = self.rho * load + (1 - self.rho) * self.mean + self.sigma * eps
            load = min(max(load, 0.0), 0.95)
            loads.append(load)


class ToggleTrace:
    """Seeded fast/slow toggling per client (FedCA §5.1, spec §6.9).

    Each client alternates fast periods (full speed) lasting ~Gamma(shape, fast_scale_s)
    and slow periods lasting ~Gamma(shape, slow_scale_s), in each of which it trains at
    1/s of its speed with s ~ U(slowdown_low, slowdown_high). A client starts fast or
    slow with the share of time each mode takes. Periods are drawn lazily from each
    client's own generator, so a multiplier never depends on the order of requests.
    """

    def __init__(
        self,
        seed: int,
        num_clients: int,
        *,
        shape: float = 2.0,
        fast_scale_s: float = 0.4,
        slow_scale_s: float = 0.06,
        slowdown_low: float = 1.0,
        slowdown_high: float = 5.0,
    ) -> None:
        for name, value in (
            ("toggle_shape", shape),
            ("toggle_fast_scale_s", fast_scale_s),
            ("toggle_slow_scale_s", slow_scale_s),
        ):
            if not (is_finite(value) and value > 0):
                raise ValueError(f"toggle trace: {name} must be a positive number, got {value!r}")
        if not (is_finite(slowdown_low) and is_finite(slowdown_high)):
            raise ValueError("toggle trace: slowdown bounds must be finite numbers")
        if not 1.0 <= slowdown_low <= slowdown_high:
            raise ValueError(
                f"toggle trace: need 1 <= slowdown_low <= slowdown_high, "
                f"got {slowdown_low!r}, {slowdown_high!r}"
            )
        self.seed, self.num_clients = seed, num_clients
        self.shape, self.fast_scale_s, self.slow_scale_s = shape, fast_scale_s, slow_scale_s
        self.slowdown = (float(slowdown_low), float(slowdown_high))
        self._ends: dict[int, list[float]] = {}  # end of each period, increasing
        self._multipliers: dict[int, list[float]] = {}  # speed fraction in each period
        self._rngs: dict[int, np.random.Generator] = {}
        self._slow_next: dict[int, bool] = {}

    def multiplier(self, partition: int, t: float) -> float:
        """Fraction of its full speed that `partition` has at virtual time `t`."""
        if t < 0:
            raise ValueError(f"toggle trace: negative time {t}")
        ends = self._grow(partition, t)
        return self._multipliers[partition][bisect.bisect_right(ends, t)]

    def next_change(self, t: float) -> float:
        """The first toggle of any client after `t` (every client, so that the event
        sequence does not depend on which clients were asked before a resume)."""
        return min(
            (ends := self._grow(p, t))[bisect.bisect_right(ends, t)]
            for p in range(self.num_clients)
        )

    def next_change_of(self, partition: int, t: float) -> float:
        """The first toggle of `partition` after `t`."""
        ends = self._grow(partition, t)
        return ends[bisect.bisect_right(ends, t)]

    def _grow(self, partition: int, t: float) -> list[float]:
        """`partition`'s periods, drawn until one ends after `t`."""
        if not 0 <= partition < self.num_clients:
            raise ValueError(f"toggle trace has no client {partition}")
        if partition not in self._rngs:
            rng = np.random.default_rng([self.seed, partition, 0x7066])
            self._rngs[partition] = rng
            fast_share = self.fast_scale_s / (self.fast_scale_s + self.slow_scale_s)
            self._slow_next[partition] = bool(rng.random() >= fast_share)
            self._ends[partition], self._multipliers[partition] = [], []
        ends, rng = self._ends[partition], self._rngs[partition]
        while not ends or ends[-1] <= t:
            slow = self._slow_next[partition]
            scale = self.slow_scale_s if slow else self.fast_scale_s
            start = ends[-1] if ends else 0.0
            ends.append(start + float(rng.gamma(self.shape, scale)))
            factor = float(rng.uniform(*self.slowdown)) if slow else 1.0
            self._multipliers[partition].append(1.0 / factor)
            self._slow_next[partition] = not slow
        return ends


class AvailabilityTrace:
    """When each client is online: sorted `[start, end)` intervals, optionally periodic.

    A client without intervals is always online. `seeded` draws alternating exponential
    on/off periods instead, lazily and per client.
    """

    def __init__(
        self,
        num_clients: int,
        intervals: Mapping[int, Sequence[Sequence[float]]],
        *,
        period_s: float | None = None,
    ) -> None:
        if period_s is not None and not (is_finite(period_s) and period_s > 0):
            raise ValueError(f"period_s must be a positive number, got {period_s!r}")
        self.num_clients, self.period_s = num_clients, period_s
        self._starts: dict[int, list[float]] = {}
        self._ends: dict[int, list[float]] = {}
        for client, spans in sorted(intervals.items()):
            if not 0 <= client < num_clients:
                raise ValueError(f"unknown client id {client} (expected 0..{num_clients - 1})")
            self._add(client, spans)
        self._renewal: tuple[int, float, float] | None = None  # seed, mean on, mean off
        self._rngs: dict[int, np.random.Generator] = {}
        self._next_on: dict[int, float] = {}

    def _add(self, client: int, spans: Sequence[Sequence[float]]) -> None:
        """Check one client's intervals; store them with touching ones merged."""
        starts: list[float] = []
        ends: list[float] = []
        for i, span in enumerate(spans):
            where = f"client {client}, interval {i} {span!r}"
            if not (isinstance(span, Sequence) and len(span) == 2):
                raise ValueError(f"{where}: expected [start, end]")
            if not all(is_finite(x) for x in span):
                raise ValueError(f"{where}: start and end must be finite numbers")
            start, end = float(span[0]), float(span[1])
            if start < 0:
                raise ValueError(f"{where}: negative time")
            if end <= start:
                raise ValueError(f"{where}: end must be after start")
            if self.period_s is not None and end > self.period_s:
                raise ValueError(f"{where}: ends after period_s={self.period_s}")
            if ends and start < ends[-1]:
                raise ValueError(f"{where}: overlaps or precedes the previous interval")
            if ends and start == ends[-1]:
                ends[-1] = end
            else:
                starts.append(start)
                ends.append(end)
        if self.period_s is not None and starts == [0.0] and ends == [self.period_s]:
            return  # online for the whole period: always online
        self._starts[client], self._ends[client] = starts, ends

    @classmethod
    def from_file(cls, path: str | Path, num_clients: int) -> AvailabilityTrace:
        """Read `{"period_s": P (optional), "clients": {"3": [[start, end], ...]}}`.

        The format FedScale's device behaviour traces are converted to (never unpickled).
        """
        try:
            raw = json.loads(read_regular_text(path))
            if not isinstance(raw, dict) or not isinstance(raw.get("clients"), dict):
                raise ValueError('expected an object with a "clients" object')
            extra = sorted(set(raw) - {"clients", "period_s"})
            if extra:
                raise ValueError(f"unknown keys {extra}")
            intervals: dict[int, Sequence[Sequence[float]]] = {}
            for client, spans in raw["clients"].items():
                canonical = client.isdecimal() and str(int(client)) == client
                if not (canonical and int(client) < num_clients):
                    raise ValueError(
                        f"unknown client id {client!r} (expected 0..{num_clients - 1})"
                    )
                if not isinstance(spans, list):
                    raise ValueError(f"client {client}: expected a list of [start, end]")
                intervals[int(client)] = spans
            return cls(num_clients, intervals, period_s=raw.get("period_s"))
        except (OSError, ValueError) as e:  # json errors are ValueErrors
            raise ValueError(f"availability trace {path}: {e}") from e

    @classmethod
    def seeded(
        cls, num_clients: int, seed: int, *, mean_online_s: float, mean_offline_s: float
    ) -> AvailabilityTrace:
        """Alternating exponential on/off periods per client, starting in the stationary state."""
        for name, value in (("mean_online_s", mean_online_s), ("mean_offline_s", mean_offline_s)):
            if not (is_finite(value) and value > 0):
                raise ValueError(f"availability trace: {name} must be positive, got {value!r}")
        trace = cls(num_clients, {})
        trace._renewal = (seed, float(mean_online_s), float(mean_offline_s))
        return trace

    def online(self, partition: int, t: float) -> bool:
        """Whether `partition` is reachable at virtual time `t`."""
        return self._interval(partition, t) is not None

    def offline_from(self, partition: int, t: float) -> float:
        """The first time at or after `t` when `partition` is offline (inf: never)."""
        while (span := self._interval(partition, t)) is not None:
            if math.isinf(span[1]):
                return math.inf
            t = span[1]
        return t

    def _interval(self, partition: int, t: float) -> tuple[float, float] | None:
        """The online interval holding `t` in absolute seconds, or None when offline."""
        if not 0 <= partition < self.num_clients:
            raise ValueError(f"availability trace has no client {partition}")
        if self._renewal is not None:
            self._grow(partition, t)
        if partition not in self._starts:
            return (-math.inf, math.inf)
        starts, ends = self._starts[partition], self._ends[partition]
        shift, period = 0.0, 0
        if self.period_s is not None:
            period = _periods(t, self.period_s)
            shift = period * self.period_s
        j = bisect.bisect_right(starts, t - shift) - 1
        if j < 0 or t - shift >= ends[j]:
            return None
        if self.period_s is not None and ends[j] == self.period_s:  # exact wrap-around
            return (starts[j] + shift, (period + 1) * self.period_s)
        return (starts[j] + shift, ends[j] + shift)

    def _grow(self, partition: int, t: float) -> None:
        """Draw `partition`'s seeded on/off periods until they decide `t`."""
        assert self._renewal is not None
        if math.isinf(t):
            raise ValueError("a seeded availability trace has no end")
        seed, on_s, off_s = self._renewal
        if partition not in self._rngs:
            rng = np.random.default_rng([seed, partition, 0x0FF1])
            self._rngs[partition] = rng
            online = rng.random() < on_s / (on_s + off_s)
            self._next_on[partition] = 0.0 if online else float(rng.exponential(off_s))
            self._starts[partition], self._ends[partition] = [], []
        rng = self._rngs[partition]
        while self._next_on[partition] <= t:
            start = self._next_on[partition]
            end = start + float(rng.exponential(on_s))
            self._starts[partition].append(start)
            self._ends[partition].append(end)
            self._next_on[partition] = end + float(rng.exponential(off_s))
