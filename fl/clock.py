"""Virtual clock: device and network heterogeneity made measurable on one machine.

Each client has a device profile (compute speed in samples/s, up/down bandwidth,
availability). Real training decides accuracy; the clock decides time, in one of two ways.
Round by round (`advance`): a synchronous round lasts as long as its slowest selected
client's download + compute + upload. Event by event (`submit`, `next_arrival`): a
discrete-event simulation in which concurrent transfers share the server's link max-min
fairly (algorithms_b §0.3: without a shared link R2SP shows no gain), compute may slow
down under a background-load trace, and devices may go offline. Between two events every
rate is constant, so each event time is exact.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Arrival",
    "AvailabilityTrace",
    "DeviceProfile",
    "Job",
    "Profiles",
    "SpeedTrace",
    "ToggleTrace",
    "VirtualClock",
    "build_profiles",
    "clock_from_config",
]

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class DeviceProfile:
    """What one client's device and link can do."""

    speed: float  # training samples per second
    up_bytes_per_s: float
    down_bytes_per_s: float
    availability: float = 1.0  # probability of being reachable in a round

    def seconds(self, samples: int, down_bytes: int, up_bytes: int) -> float:
        """Time for one round of work: download, local training, upload."""
        return (
            down_bytes / self.down_bytes_per_s
            + samples / self.speed
            + up_bytes / self.up_bytes_per_s
        )


def _spread(rng: np.random.Generator, base: float, ratio: float, n: int) -> np.ndarray:
    """`n` values log-uniform in [base/sqrt(ratio), base*sqrt(ratio)]: max/min = ratio."""
    if ratio <= 1.0:
        return np.full(n, base)
    half = np.log(ratio) / 2
    return base * np.exp(rng.uniform(-half, half, n))


def _lognormal(rng: np.random.Generator, median: float, ratio: float, n: int) -> np.ndarray:
    """`n` log-normal values around `median`, sigma = ln(ratio)/4, cut at +-2 sigma: the
    bulk near the median, max/min at most `ratio` (FedCA's base speeds, spec §6.9)."""
    if ratio <= 1.0:
        return np.full(n, median)
    sigma = np.log(ratio) / 4
    return median * np.exp(sigma * np.clip(rng.standard_normal(n), -2.0, 2.0))


SPEED_DISTRIBUTIONS = {"loguniform": _spread, "lognormal": _lognormal}


def build_profiles(
    num_clients: int,
    *,
    seed: int,
    speed: float,
    up_mbps: float,
    down_mbps: float,
    availability: float = 1.0,
    speed_spread: float = 1.0,
    bandwidth_spread: float = 1.0,
    speed_distribution: str = "loguniform",
) -> Profiles:
    """Seeded profiles; a spread of 1 gives identical devices, 20 a 20x fastest/slowest gap.

    Speeds are log-uniform over the spread, or log-normal within it (`lognormal`).
    """
    if speed_distribution not in SPEED_DISTRIBUTIONS:
        raise ValueError(
            f"system.speed_distribution must be one of {sorted(SPEED_DISTRIBUTIONS)}, "
            f"not {speed_distribution!r}"
        )
    rng = np.random.default_rng([seed, 0xC10C])
    speeds = SPEED_DISTRIBUTIONS[speed_distribution](rng, speed, speed_spread, num_clients)
    ups = _spread(rng, up_mbps * MBIT, bandwidth_spread, num_clients)
    downs = _spread(rng, down_mbps * MBIT, bandwidth_spread, num_clients)
    return Profiles(speeds, ups, downs, np.full(num_clients, float(availability)))


class Profiles(Sequence[DeviceProfile]):
    """Many clients' profiles as four arrays (32 bytes a client); an item is built when read.

    The arrays are made read-only: profiles are fixed for a run, so facts about the whole
    population (`always_available`) are computed once, not once a round.
    """

    def __init__(
        self, speed: np.ndarray, up: np.ndarray, down: np.ndarray, availability: np.ndarray
    ) -> None:
        for values in (speed, up, down, availability):
            values.setflags(write=False)
        self.speed, self.up, self.down = speed, up, down
        self.availability = availability

    @cached_property
    def always_available(self) -> bool:
        """Whether every client is reachable in every round (availability 1)."""
        return bool(np.all(self.availability >= 1.0))

    @classmethod
    def of(cls, profiles: Sequence[DeviceProfile]) -> Profiles:
        """The same profiles, held as arrays."""
        if isinstance(profiles, Profiles):
            return profiles
        fields = [[getattr(p, f) for p in profiles] for f in _PROFILE_FIELDS]
        return cls(*(np.asarray(values, dtype=np.float64) for values in fields))

    def __len__(self) -> int:
        return len(self.speed)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return DeviceProfile(
            float(self.speed[i]),
            float(self.up[i]),
            float(self.down[i]),
            float(self.availability[i]),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def max_seconds(self, samples: int, down_bytes: int, up_bytes: int) -> float:
        """The slowest client's `DeviceProfile.seconds`, computed for all at once."""
        seconds = down_bytes / self.down + samples / self.speed + up_bytes / self.up
        return float(seconds.max())


_PROFILE_FIELDS = ("speed", "up_bytes_per_s", "down_bytes_per_s", "availability")


@dataclass(frozen=True)
class Job:
    """One client's round trip as the clock simulates it."""

    key: int  # unique among jobs in flight (the loop uses the node id)
    partition: int  # index into the clock's profiles
    down_bytes: int
    samples: int  # training samples to process, at the client's speed
    # (fraction of `samples` done before this part may leave, bytes): parts leave one after
    # another on the client's uplink while compute goes on. Usually ((1.0, up_bytes),);
    # empty when nothing is uploaded.
    uploads: tuple[tuple[float, int], ...]


@dataclass(frozen=True)
class Arrival:
    """When each phase of a job ended (virtual seconds since training began).

    A job is done once its compute has ended and its last upload part has reached the
    server. Phases a dropped job never reached are `inf`.
    """

    key: int
    partition: int
    sent_s: float
    downloaded_s: float
    computed_s: float
    arrived_s: float  # the last upload part has fully reached the server (or the drop)
    dropped: bool = False  # the device went offline before arriving: the reply never comes


def _periods(t: float, length: float) -> int:
    """The largest k with k*length <= t, so a boundary computed as k*length is exact."""
    k = math.floor(t / length)
    if (k + 1) * length <= t:
        return k + 1
    return k - 1 if k * length > t else k


def _is_number(x: object) -> bool:
    """A finite int or float, not a bool: what a trace or its parameters may hold."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


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
        if not (_is_number(slot_s) and slot_s > 0):
            raise ValueError(f"speed trace: slot_s must be a positive number, got {slot_s!r}")
        for name, value, high in (("mean", mean, 0.95), ("rho", rho, 1.0), ("sigma", sigma, None)):
            if not (_is_number(value) and value >= 0 and (high is None or value <= high)):
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
            if not (_is_number(value) and value > 0):
                raise ValueError(f"toggle trace: {name} must be a positive number, got {value!r}")
        if not (_is_number(slowdown_low) and _is_number(slowdown_high)):
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
        if period_s is not None and not (_is_number(period_s) and period_s > 0):
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
            if not all(_is_number(x) for x in span):
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
            raw = json.loads(Path(path).read_text())
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
            if not (_is_number(value) and value > 0):
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


@dataclass
class _Flight:
    """A submitted job and the phases it has passed (inf: not yet)."""

    job: Job
    sent_s: float
    downloaded_s: float = math.inf
    computed_s: float = math.inf
    part: int = 0  # the upload part at the head of the client's uplink queue
    sending: bool = False  # whether that part is on the wire


# The jobs in flight as a table `[field, activity, job]`. Each activity progresses at a
# constant `rate` from `done` at time `since` towards `goal`, which it reaches at `end`
# (inf when idle): an event costs a few array operations, and only rate changes touch
# the table.
_FIELDS = ("done", "goal", "rate", "since", "end", "cap")
_DONE, _GOAL, _RATE, _SINCE, _END, _CAP = range(len(_FIELDS))
_ACTIVITIES = ("download", "compute", "upload")  # bytes, samples, bytes
_DOWN, _COMPUTE, _UP = range(len(_ACTIVITIES))


def _max_min_rates(caps: np.ndarray, capacity: float) -> np.ndarray:
    """Max-min fair shares of `capacity` among flows capped at `caps` (water-filling)."""
    if math.isinf(capacity):
        return caps.copy()
    ordered = np.sort(caps)
    before = np.concatenate(([0.0], np.cumsum(ordered[:-1])))
    fair = (capacity - before) / np.arange(caps.size, 0, -1)
    unsaturated = np.flatnonzero(ordered > fair)  # the first one sets everyone's level
    if unsaturated.size == 0:
        return caps.copy()
    return np.minimum(caps, fair[unsaturated[0]])


class VirtualClock:
    """Simulated seconds since the start of training, advanced by rounds or by events."""

    def __init__(
        self,
        profiles: Sequence[DeviceProfile],
        seed: int,
        now: float = 0.0,
        *,
        server_bytes_per_s: float = math.inf,
        speed_trace: SpeedTrace | ToggleTrace | None = None,
        availability_trace: AvailabilityTrace | None = None,
    ) -> None:
        if not server_bytes_per_s > 0:
            raise ValueError(f"server_bytes_per_s must be positive, got {server_bytes_per_s}")
        self.profiles = Profiles.of(profiles)
        self.seed = seed
        self.now = float(now)
        self.server_bytes_per_s = server_bytes_per_s  # each direction (full duplex)
        self.speed_trace = speed_trace
        self.availability_trace = availability_trace
        self._flights: list[_Flight] = []  # job i of the table
        self._table = np.empty((len(_FIELDS), len(_ACTIVITIES), 0))
        self._drops = np.empty(0)  # when each job's device goes offline
        self._changed = [False] * len(_ACTIVITIES)  # transfers started or ended: share anew
        self._keys: set[int] = set()  # in flight: submitted, not yet returned
        self._arrived: list[Arrival] = []  # done, not yet returned; by (arrived_s, key)

    def available(self, server_round: int, partitions: Iterable[int]) -> list[int]:
        """The partitions reachable in this round.

        Online at `now` under an availability trace; otherwise a seeded draw per client
        and round.
        """
        if self.availability_trace is not None:
            trace = self.availability_trace
            return [p for p in partitions if trace.online(p, self.now)]
        reachable = self.reachable(server_round)
        return [p for p in partitions if reachable[p]]

    def reachable(self, server_round: int) -> np.ndarray:
        """Whether each partition is reachable in this round (bool array, one per client)."""
        if self.availability_trace is not None:
            trace = self.availability_trace
            return np.array([trace.online(p, self.now) for p in range(len(self.profiles))])
        if self.profiles.always_available:  # every draw in [0, 1) passes
            return np.ones(len(self.profiles), dtype=bool)
        draws = np.random.default_rng([self.seed, server_round, 0xA7A1]).random(len(self.profiles))
        return draws < self.profiles.availability

    def speed(self, partition: int, t: float) -> float:
        """Samples per second `partition` trains at at time `t` (background load included)."""
        load = 1.0 if self.speed_trace is None else self.speed_trace.multiplier(partition, t)
        return self.profiles[partition].speed * load

    def submit(self, job: Job) -> None:
        """Start `job` at `now`, download first."""
        if job.key in self._keys:
            raise ValueError(f"job {job.key} is already in flight")
        if not 0 <= job.partition < len(self.profiles):
            raise ValueError(f"job {job.key}: no profile for partition {job.partition}")
        if job.down_bytes < 0 or job.samples < 0:
            raise ValueError(f"job {job.key}: negative bytes or samples")
        for fraction, size in job.uploads:
            if not (0.0 <= fraction <= 1.0 and size >= 0):
                raise ValueError(f"job {job.key}: bad upload part ({fraction}, {size})")
        profile = self.profiles[job.partition]
        column = np.zeros((len(_FIELDS), len(_ACTIVITIES)))
        column[_SINCE], column[_END] = self.now, math.inf
        column[_CAP] = (profile.down_bytes_per_s, math.inf, profile.up_bytes_per_s)
        column[_GOAL, _DOWN] = job.down_bytes
        self._keys.add(job.key)
        self._flights.append(_Flight(job, self.now))
        self._table = np.concatenate([self._table, column[:, :, None]], axis=2)
        self._drops = np.append(self._drops, self._drop_s(job.partition, self.now))
        i = len(self._flights) - 1
        if job.down_bytes > 0:
            self._start(i, _DOWN, 0.0, job.down_bytes, profile.down_bytes_per_s)
        self._retire([i])

    def in_flight(self) -> list[int]:
        """Keys of submitted jobs not yet returned by `next_arrival`."""
        return sorted(self._keys)

    def next_arrival(self, until: float = math.inf) -> Arrival | None:
        """The earliest job completion (arrival or drop) at or before `until`, or None.

        `now` moves to it, or to `until` when nothing completes by then; it never moves
        back, so a completion that happened during a `wait` keeps its own time.
        """
        if not self._arrived:
            self._run(until, to_first_arrival=True)
        if not (self._arrived and self._arrived[0].arrived_s <= until):
            return None
        arrival = self._arrived.pop(0)
        self._keys.remove(arrival.key)
        return arrival

    def wait(self, seconds: float) -> None:
        """The server is busy for `seconds` (aggregating) while jobs in flight go on."""
        if not seconds >= 0:
            raise ValueError(f"cannot wait {seconds} s")
        self._run(self.now + seconds, to_first_arrival=False)

    def cancel(self, key: int) -> None:
        """Stop waiting for job `key`: its transfers leave the link from `now` on."""
        if key not in self._keys:
            raise KeyError(f"job {key} is not in flight")
        self._keys.remove(key)
        self._arrived = [a for a in self._arrived if a.key != key]
        gone = [i for i, f in enumerate(self._flights) if f.job.key == key]
        self._remove(gone)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue mid-flight, as plain Python values.

        Traces are pure functions of their seeds, so they carry no state of their own.
        """
        self._share_server_link()  # as the next step would, at the same `now`
        jobs = []
        for i, flight in enumerate(self._flights):
            job = flight.job
            activities = self._table[:, :, i].T.tolist()
            jobs.append(
                {
                    "key": int(job.key),
                    "partition": int(job.partition),
                    "down_bytes": int(job.down_bytes),
                    "samples": int(job.samples),
                    "uploads": [[float(f), int(b)] for f, b in job.uploads],
                    "sent_s": float(flight.sent_s),
                    "downloaded_s": float(flight.downloaded_s),
                    "computed_s": float(flight.computed_s),
                    "part": flight.part,
                    "sending": flight.sending,
                    "drop_s": float(self._drops[i]),
                    **{
                        name: dict(zip(_FIELDS, values, strict=True))
                        for name, values in zip(_ACTIVITIES, activities, strict=True)
                    },
                }
            )
        return {"now": float(self.now), "jobs": jobs, "arrived": [asdict(a) for a in self._arrived]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from what `state_dict` returned."""
        self.now = float(state["now"])
        self._flights, columns = [], []
        for s in state["jobs"]:
            uploads = tuple((float(f), int(b)) for f, b in s["uploads"])
            job = Job(s["key"], s["partition"], s["down_bytes"], s["samples"], uploads)
            flight = _Flight(job, s["sent_s"], s["downloaded_s"], s["computed_s"])
            flight.part, flight.sending = s["part"], s["sending"]
            self._flights.append(flight)
            columns.append([[s[name][field] for name in _ACTIVITIES] for field in _FIELDS])
        table = np.array(columns, dtype=float).reshape(-1, len(_FIELDS), len(_ACTIVITIES))
        self._table = np.ascontiguousarray(table.transpose(1, 2, 0))
        self._drops = np.array([s["drop_s"] for s in state["jobs"]], dtype=float)
        self._arrived = [Arrival(**a) for a in state["arrived"]]
        self._keys = {f.job.key for f in self._flights} | {a.key for a in self._arrived}
        self._changed = [False] * len(_ACTIVITIES)  # state_dict shared the link before saving

    # ----- simulation -------------------------------------------------------------------
    def _drop_s(self, partition: int, t: float) -> float:
        """When a job sent to `partition` at `t` is lost to its device going offline."""
        trace = self.availability_trace
        return math.inf if trace is None else trace.offline_from(partition, t)

    def _run(self, until: float, *, to_first_arrival: bool) -> None:
        """Simulate events up to `until`, or only up to the first completion."""
        while not (to_first_arrival and self._arrived) and self._step(until):
            pass

    def _step(self, until: float) -> bool:
        """Process the next event if it comes by `until`, else move to `until`; False then."""
        self._share_server_link()
        table, n = self._table, len(self._flights)
        t_next = float(min(table[_END].min(), self._drops.min())) if n else math.inf
        slot_end = math.inf
        if self.speed_trace is not None and (table[_RATE, _COMPUTE] > 0).any():
            slot_end = self.speed_trace.next_change(self.now)
            t_next = min(t_next, slot_end)
        if t_next > until or math.isinf(t_next):
            if math.isfinite(until):
                self.now = max(self.now, until)
            return False
        self.now = t_next
        activity, job = np.nonzero(table[_END] <= t_next)
        table[_DONE, activity, job] = table[_GOAL, activity, job]
        table[_SINCE, activity, job] = t_next
        due = np.zeros(n, dtype=bool)
        due[job] = True
        due |= self._drops <= t_next
        if t_next == slot_end:  # a new background load: every computing job changes pace
            due |= table[_RATE, _COMPUTE] > 0
        self._retire(np.flatnonzero(due).tolist())
        return True

    def _retire(self, indices: list[int]) -> None:
        """Settle these jobs; move the finished and the dropped to the arrivals."""
        gone: list[int] = []
        for i in indices:
            arrived = self._settle(i)
            if arrived or self._drops[i] <= self.now:
                f = self._flights[i]
                arrival = Arrival(
                    f.job.key, f.job.partition, f.sent_s, f.downloaded_s, f.computed_s,
                    self.now, dropped=not arrived,
                )  # fmt: skip
                bisect.insort(self._arrived, arrival, key=lambda a: (a.arrived_s, a.key))
                gone.append(i)
        self._remove(gone)

    def _remove(self, indices: list[int]) -> None:
        """Drop these jobs from the table: their transfers leave the server's link."""
        if indices:
            for activity in (_DOWN, _UP):
                self._changed[activity] |= bool((self._table[_RATE, activity, indices] > 0).any())
            self._table = np.delete(self._table, indices, axis=2)
            self._drops = np.delete(self._drops, indices)
            for i in reversed(indices):
                del self._flights[i]

    def _share_server_link(self) -> None:
        """Give every transfer its max-min share of the server's link from `now` on.

        Only where transfers started or ended since the last time: before time moves on.
        """
        table, changed = self._table, self._changed
        for activity in (_DOWN, _UP):
            if math.isinf(self.server_bytes_per_s) or not changed[activity]:
                continue  # alone, or at its client's own rate, a transfer keeps its pace
            changed[activity] = False
            (jobs,) = np.nonzero(table[_RATE, activity] > 0)
            flows = table[:, activity, jobs]
            done = flows[_DONE] + flows[_RATE] * (self.now - flows[_SINCE])
            rate = _max_min_rates(flows[_CAP], self.server_bytes_per_s)
            table[_DONE, activity, jobs] = done
            table[_RATE, activity, jobs] = rate
            table[_SINCE, activity, jobs] = self.now
            table[_END, activity, jobs] = self.now + np.maximum(flows[_GOAL] - done, 0) / rate

    def _start(self, i: int, activity: int, done: float, goal: float, rate: float) -> None:
        """Run one activity of job i from `now` at a constant rate."""
        column = self._table[:, activity, i]
        column[_DONE], column[_GOAL], column[_RATE] = done, goal, rate
        column[_SINCE], column[_END] = self.now, self.now + max(goal - done, 0.0) / rate
        self._changed[activity] = True

    def _stop(self, i: int, activity: int) -> None:
        """Job i's activity has reached its goal."""
        self._table[_RATE, activity, i], self._table[_END, activity, i] = 0.0, math.inf
        self._changed[activity] = True

    def _settle(self, i: int) -> bool:
        """Take job i through every phase that needs no more time; True once it has arrived."""
        flight, job = self._flights[i], self._flights[i].job
        down, compute, up = (
            self._table[:, _DOWN, i],
            self._table[:, _COMPUTE, i],
            self._table[:, _UP, i],
        )
        if down[_DONE] < down[_GOAL]:
            return False
        if math.isinf(flight.downloaded_s):
            flight.downloaded_s = self.now
            self._stop(i, _DOWN)
        if flight.sending and up[_DONE] >= up[_GOAL]:
            flight.part, flight.sending = flight.part + 1, False
            self._stop(i, _UP)
        done = compute[_DONE] + compute[_RATE] * (self.now - compute[_SINCE])
        while not flight.sending and flight.part < len(job.uploads):
            fraction, size = job.uploads[flight.part]
            if done < fraction * job.samples:
                break  # not ready yet: compute stops at this milestone to wake it
            if size > 0:
                self._start(i, _UP, 0.0, size, up[_CAP])
                flight.sending = True
            else:
                flight.part += 1
        if done < job.samples:
            waiting = not flight.sending and flight.part < len(job.uploads)
            goal = job.uploads[flight.part][0] * job.samples if waiting else job.samples
            self._start(i, _COMPUTE, done, goal, self.speed(job.partition, self.now))
            return False
        if math.isinf(flight.computed_s):
            flight.computed_s = self.now
            self._stop(i, _COMPUTE)
        return flight.part == len(job.uploads)


_PROFILE_KEYS = ("speed", "up_mbps", "down_mbps")
_OPTIONAL_KEYS = (
    "name",
    "availability",
    "speed_spread",
    "bandwidth_spread",
    "speed_distribution",
    "server_bandwidth_mbps",
    "speed_trace",
    "trace_slot_s",
    "load_mean",
    "load_rho",
    "load_sigma",
    "toggle_shape",
    "toggle_fast_scale_s",
    "toggle_slow_scale_s",
    "slowdown_low",
    "slowdown_high",
    "availability_trace",
    "mean_online_s",
    "mean_offline_s",
)


def clock_from_config(options: Mapping[str, Any], num_clients: int, seed: int) -> VirtualClock:
    """The clock a `system` config describes (absent or null trace keys: that trace is off)."""
    unknown = sorted(set(options) - set(_PROFILE_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise ValueError(f"unknown system options: {unknown}")
    given = {k: v for k, v in options.items() if v is not None}
    missing = [k for k in _PROFILE_KEYS if k not in given]
    if missing:
        raise ValueError(f"missing system options: {missing}")
    spreads = ("availability", "speed_spread", "bandwidth_spread", "speed_distribution")
    profiles = build_profiles(
        num_clients, seed=seed, **{k: given[k] for k in (*_PROFILE_KEYS, *spreads) if k in given}
    )
    server_mbps = given.get("server_bandwidth_mbps")
    return VirtualClock(
        profiles,
        seed,
        server_bytes_per_s=math.inf if server_mbps is None else server_mbps * MBIT,
        speed_trace=_speed_trace(given, num_clients, seed),
        availability_trace=_availability_trace(given, num_clients, seed),
    )


def _speed_trace(
    given: Mapping[str, Any], num_clients: int, seed: int
) -> SpeedTrace | ToggleTrace | None:
    """`speed_trace: ar1` (slot and load parameters) or `toggle` (period parameters)."""
    kind = given.get("speed_trace")
    if kind is None:
        return None
    if kind == "toggle":
        toggles = {
            "toggle_shape": "shape",
            "toggle_fast_scale_s": "fast_scale_s",
            "toggle_slow_scale_s": "slow_scale_s",
            "slowdown_low": "slowdown_low",
            "slowdown_high": "slowdown_high",
        }
        options = {v: given[k] for k, v in toggles.items() if k in given}
        return ToggleTrace(seed, num_clients, **options)
    if kind != "ar1":
        raise ValueError(f"system.speed_trace must be 'ar1', 'toggle' or null, not {kind!r}")
    names = {
        "trace_slot_s": "slot_s",
        "load_mean": "mean",
        "load_rho": "rho",
        "load_sigma": "sigma",
    }
    return SpeedTrace(seed, **{v: given[k] for k, v in names.items() if k in given})


def _availability_trace(
    given: Mapping[str, Any], num_clients: int, seed: int
) -> AvailabilityTrace | None:
    """`availability_trace`: a JSON file, or `seeded` with mean on and off periods."""
    source = given.get("availability_trace")
    if source is None:
        return None
    if source != "seeded":
        return AvailabilityTrace.from_file(source, num_clients)
    means = [k for k in ("mean_online_s", "mean_offline_s") if k not in given]
    if means:
        raise ValueError(f"system.availability_trace: seeded needs {means}")
    return AvailabilityTrace.seeded(
        num_clients,
        seed,
        mean_online_s=given["mean_online_s"],
        mean_offline_s=given["mean_offline_s"],
    )
