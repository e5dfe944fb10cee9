"""Virtual clock: device and network heterogeneity made measurable on one machine.

Each client has a device profile (compute speed in samples/s, up/down bandwidth,
availability). Real training decides accuracy; the clock decides time, in one of two ways.
Round by round (`advance`): a synchronous round lasts as long as its slowest selected
client's download + compute + upload. Event by event (`submit`, `next_arrival`): a
discrete-event simulation in which concurrent transfers share the server's link max-min
fairly (algorithms_b §0.3: without a shared link R2SP shows no gain), compute may slow
down under a background-load trace, and devices may go offline. Between two events every
rate is constant, so each event time is exact. Where jobs cannot meet (no shared link, no
load or availability trace) and upload once at the end, each one's phases are known when
it starts: the clock schedules its arrival at submit, with the same float operations the
events would take, and an event costs no table work.

Why one module: the clock, its flights, the shared link and the traces it reads are one
event simulation whose invariants (every rate constant between two events) hold only
together; its config check sits beside it as every subsystem's does.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from omegaconf import DictConfig

from fl.common.config import ConfigError, check_number, is_finite, require
from fl.world.devices import MBIT, DeviceProfile, Profiles, build_profiles
from fl.world.traces import AvailabilityTrace, SpeedTrace, ToggleTrace

__all__ = [
    "MBIT",
    "Arrival",
    "AvailabilityTrace",
    "DeviceProfile",
    "Job",
    "Profiles",
    "SpeedTrace",
    "ToggleTrace",
    "VirtualClock",
    "build_profiles",
    "check_system",
    "clock_from_config",
]


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


def _time_or_never(value: Any) -> bool:
    """A saved time (or bound) that is finite, or inf: not reached, no cap."""
    return is_finite(value) or value == math.inf


def _activity_ok(row: Sequence[Any], now: float) -> bool:
    """A saved activity's row (`_FIELDS`) that the clock could have written by `now`:
    progress within its goal, a finite rate, begun by now, ending no earlier than begun."""
    done, goal, rate, since, end, cap = row
    return (
        all(is_finite(v) for v in (done, goal, rate, since))
        and _time_or_never(end)
        and _time_or_never(cap)
        and 0 <= done <= goal * (1 + 1e-9) + 1e-9  # (rounding of its last progress)
        and rate >= 0
        and cap >= 0
        and since <= now
        and end >= since
    )


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
        # independent jobs' arrivals, known at submit, not yet reached: a heap by time, key
        self._scheduled: list[tuple[float, int, Arrival]] = []

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
        return float(self.profiles.speed[partition]) * load

    def speed_segments(
        self, partition: int, start: float, until: float, limit: int = 64
    ) -> list[tuple[float, float]]:
        """`partition`'s speed from `start` on as (seconds after `start`, samples/s) at each
        change before `until`, at most `limit` of them (the last speed holds after): what
        the device itself sees of its speed during a round (FedCA's client clock)."""
        segments = [(0.0, self.speed(partition, start))]
        if self.speed_trace is None:
            return segments
        t = start
        for _ in range(16 * limit):  # bounded even where the speed seldom changes
            t = self.speed_trace.next_change_of(partition, t)
            if not t < until or len(segments) == limit:
                break
            speed = self.speed(partition, t)
            if speed != segments[-1][1]:
                segments.append((t - start, speed))
        return segments

    def submit(self, job: Job) -> None:
        """Start `job` at `now`, download first."""
        self.submit_many([job])

    def submit_many(self, jobs: Sequence[Job]) -> None:
        """Start `jobs` at `now`, as `submit` one by one would, with the table grown once
        (a round's thousand jobs would otherwise copy it a thousand times)."""
        keys: set[int] = set()
        for job in jobs:
            if job.key in self._keys or job.key in keys:
                raise ValueError(f"job {job.key} is already in flight")
            if not 0 <= job.partition < len(self.profiles):
                raise ValueError(f"job {job.key}: no profile for partition {job.partition}")
            if job.down_bytes < 0 or job.samples < 0:
                raise ValueError(f"job {job.key}: negative bytes or samples")
            for fraction, size in job.uploads:
                if not (0.0 <= fraction <= 1.0 and size >= 0):
                    raise ValueError(f"job {job.key}: bad upload part ({fraction}, {size})")
            keys.add(job.key)
        if not jobs:
            return
        self._keys |= keys
        if self._independent:
            self._schedule([job for job in jobs if _uploads_at_end(job)])
            jobs = [job for job in jobs if not _uploads_at_end(job)]
            if not jobs:
                return
        where = np.array([job.partition for job in jobs])
        columns = np.zeros((len(_FIELDS), len(_ACTIVITIES), len(jobs)))
        columns[_SINCE], columns[_END] = self.now, math.inf
        columns[_CAP, _DOWN], columns[_CAP, _COMPUTE] = self.profiles.down[where], math.inf
        columns[_CAP, _UP] = self.profiles.up[where]
        columns[_GOAL, _DOWN] = [job.down_bytes for job in jobs]
        first = len(self._flights)
        self._flights += [_Flight(job, self.now) for job in jobs]
        self._table = np.concatenate([self._table, columns], axis=2)
        drops = [self._drop_s(job.partition, self.now) for job in jobs]
        self._drops = np.concatenate([self._drops, drops])
        settle = []  # a job still downloading, its device online, has nothing to settle yet
        for i, job in enumerate(jobs, first):
            if job.down_bytes > 0:
                self._start(i, _DOWN, 0.0, job.down_bytes, self._table[_CAP, _DOWN, i])
            if job.down_bytes == 0 or self._drops[i] <= self.now:
                settle.append(i)
        self._retire(settle)

    @property
    def _independent(self) -> bool:
        """Whether no job can change another's pace or its own: no shared link, no traces."""
        return (
            math.isinf(self.server_bytes_per_s)
            and self.speed_trace is None
            and self.availability_trace is None
        )

    def _schedule(self, jobs: Sequence[Job]) -> None:
        """Each job's phases at once, as the events would end them: download from `now`,
        compute from the download's end, the one upload from the compute's end."""
        if not jobs:
            return
        where = np.array([job.partition for job in jobs])
        down = np.array([job.down_bytes for job in jobs], dtype=float)
        samples = np.array([job.samples for job in jobs], dtype=float)
        up = np.array([job.uploads[0][1] if job.uploads else 0 for job in jobs], dtype=float)
        now = self.now
        with np.errstate(divide="ignore", invalid="ignore"):  # the zeros are masked out
            downloaded = np.where(down > 0, now + down / self.profiles.down[where], now)
            computed = np.where(
                samples > 0, downloaded + samples / self.profiles.speed[where], downloaded
            )
            arrived = np.where(up > 0, computed + up / self.profiles.up[where], computed)
        for job, d, c, a in zip(
            jobs, downloaded.tolist(), computed.tolist(), arrived.tolist(), strict=True
        ):
            arrival = Arrival(job.key, job.partition, now, d, c, a)
            heapq.heappush(self._scheduled, (a, job.key, arrival))

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

    def cancel(self, key: int) -> bool:
        """Stop waiting for job `key`: its transfers leave the link from `now` on.

        Returns whether its download had ended by `now` (its client holds the message).
        """
        if key not in self._keys:
            raise KeyError(f"job {key} is not in flight")
        self._keys.remove(key)
        gone = [i for i, f in enumerate(self._flights) if f.job.key == key]
        ends = [self._flights[i].downloaded_s for i in gone]
        ends += [a.downloaded_s for a in self._arrived if a.key == key]
        self._arrived = [a for a in self._arrived if a.key != key]
        scheduled = [a.downloaded_s for _, k, a in self._scheduled if k == key]
        if scheduled:
            ends += scheduled
            self._scheduled = [entry for entry in self._scheduled if entry[1] != key]
            heapq.heapify(self._scheduled)
        self._remove(gone)
        return bool(ends) and ends[0] <= self.now

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
        return {
            "now": float(self.now),
            "jobs": jobs,
            "arrived": [asdict(a) for a in self._arrived],
            "scheduled": [asdict(a) for _, _, a in sorted(self._scheduled)],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from what `state_dict` returned."""
        now = state["now"]
        if not (is_finite(now) and now >= 0):
            raise ValueError(f"clock state: a bad time now: {now!r}")
        self.now = float(now)
        self._flights, columns = [], []
        for s in state["jobs"]:
            flight = self._saved_flight(s)
            self._flights.append(flight)
            columns.append([[s[name][field] for name in _ACTIVITIES] for field in _FIELDS])
        table = np.array(columns, dtype=float).reshape(-1, len(_FIELDS), len(_ACTIVITIES))
        self._table = np.ascontiguousarray(table.transpose(1, 2, 0))
        self._drops = np.array([s["drop_s"] for s in state["jobs"]], dtype=float)
        self._arrived = [self._saved_arrival(a, due=True) for a in state["arrived"]]
        scheduled = [self._saved_arrival(a, due=False) for a in state.get("scheduled", [])]
        self._scheduled = [(a.arrived_s, a.key, a) for a in scheduled]
        heapq.heapify(self._scheduled)
        keys = [f.job.key for f in self._flights] + [a.key for a in self._arrived + scheduled]
        if len(set(keys)) != len(keys):
            raise ValueError("clock state: a job key appears twice")
        self._keys = set(keys)
        self._changed = [False] * len(_ACTIVITIES)  # state_dict shared the link before saving

    def _saved_flight(self, saved: Mapping[str, Any]) -> _Flight:
        """A checkpoint's job in flight, checked (the file is untrusted): its ids, a known
        partition, sizes and upload parts, phases passed in order by now, and each
        activity's progress (no NaN, nothing negative, nothing begun after now, done within
        its goal)."""
        try:
            uploads = tuple((f, b) for f, b in saved["uploads"])
            job = Job(
                saved["key"], saved["partition"], saved["down_bytes"], saved["samples"], uploads
            )
            flight = _Flight(job, saved["sent_s"], saved["downloaded_s"], saved["computed_s"])
            flight.part, flight.sending = saved["part"], saved["sending"]
            activities = [saved[name] for name in _ACTIVITIES]
            fields = [[a[field] for field in _FIELDS] for a in activities]
            drop_s = saved["drop_s"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"clock state: a bad job in flight: {saved}") from None
        fractions = [f for f, _ in uploads]
        ok = (
            all(type(n) is int and n >= 0 for n in (job.key, job.down_bytes, job.samples))
            and type(job.partition) is int
            and 0 <= job.partition < len(self.profiles)
            and all(is_finite(f) and 0 <= f <= 1 for f in fractions)
            and fractions == sorted(fractions)
            and all(type(b) is int and b >= 0 for _, b in uploads)
            and type(flight.part) is int
            and 0 <= flight.part <= len(uploads)
            and isinstance(flight.sending, bool)
            and is_finite(flight.sent_s)
            and 0 <= flight.sent_s <= self.now
            and all(
                _time_or_never(t) and (t == math.inf or flight.sent_s <= t <= self.now)
                for t in (flight.downloaded_s, flight.computed_s)
            )
            and (flight.computed_s == math.inf or flight.downloaded_s <= flight.computed_s)
            and _time_or_never(drop_s)
            and drop_s >= flight.sent_s
            and all(_activity_ok(row, self.now) for row in fields)
        )
        if not ok:
            raise ValueError(f"clock state: a bad job in flight: {saved}")
        return flight

    def _saved_arrival(self, saved: Mapping[str, Any], *, due: bool) -> Arrival:
        """A checkpoint's arrival, checked (the file is untrusted): its ids, a known
        partition, phases in order, and its time reached (`due`) or yet to come."""
        arrival = Arrival(**saved)
        phases = (arrival.sent_s, arrival.downloaded_s, arrival.computed_s, arrival.arrived_s)
        reached = [t for t in phases if t != math.inf]  # a phase never reached (a drop's)
        ordered = all(map(_time_or_never, phases)) and all(
            arrival.sent_s <= t <= arrival.arrived_s for t in reached
        )
        ok = (
            type(arrival.key) is int
            and type(arrival.partition) is int
            and 0 <= arrival.partition < len(self.profiles)
            and isinstance(arrival.dropped, bool)
            and ordered
            and math.isfinite(arrival.arrived_s)
            and (arrival.arrived_s <= self.now if due else arrival.arrived_s >= self.now)
            and (due or not arrival.dropped)
        )
        if not ok:
            raise ValueError(f"clock state: a bad {'arrival' if due else 'scheduled job'}: {saved}")
        return arrival

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
        if self._scheduled:
            t_next = min(t_next, self._scheduled[0][0])
        slot_end = math.inf
        if self.speed_trace is not None and (table[_RATE, _COMPUTE] > 0).any():
            slot_end = self.speed_trace.next_change(self.now)
            t_next = min(t_next, slot_end)
        if t_next > until or math.isinf(t_next):
            if math.isfinite(until):
                self.now = max(self.now, until)
            return False
        self.now = t_next
        while self._scheduled and self._scheduled[0][0] <= t_next:
            arrival = heapq.heappop(self._scheduled)[2]
            bisect.insort(self._arrived, arrival, key=lambda a: (a.arrived_s, a.key))
        if not n:
            return True
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
        # each activity's fields as floats (read once: a numpy scalar costs more per use);
        # the writes below go through `_start` and `_stop` and none is read back here
        down, compute, up = self._table[:, :, i].T.tolist()  # _DOWN, _COMPUTE, _UP
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


def _uploads_at_end(job: Job) -> bool:
    """Whether the job uploads at most once, after its compute (the usual reply)."""
    return not job.uploads or (len(job.uploads) == 1 and job.uploads[0][0] == 1.0)


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


def check_system(cfg: DictConfig) -> None:
    """The `system` group: the device and network profile this clock is built from."""
    for key in ("speed", "up_mbps", "down_mbps"):
        check_number(cfg, f"system.{key}", 0, strict=True)
    for key in ("speed_spread", "bandwidth_spread"):
        check_number(cfg, f"system.{key}", 1)
    check_number(cfg, "system.availability", 0, 1, strict=True)
    check_number(cfg, "system.server_bandwidth_mbps", 0, strict=True, null=True)
    check_number(cfg, "system.aggregation_s_per_update", 0)
    _check_traces(cfg)


def _check_traces(cfg: DictConfig) -> None:
    """The trace keys, and a trace file read as the run will read it: a missing or
    malformed file is one config error before the run, not a traceback in round 1."""
    system = cfg.get("system") or {}
    kind = system.get("speed_trace")
    require(kind in (None, "ar1", "toggle"), "system.speed_trace", kind, "ar1, toggle or null")
    source = system.get("availability_trace")
    if source is None:
        return
    if source == "seeded":
        means = [k for k in ("mean_online_s", "mean_offline_s") if system.get(k) is None]
        require(not means, "system.availability_trace", source, f"seeded needs {means}")
        return
    try:
        AvailabilityTrace.from_file(str(source), int(cfg.num_clients))
    except ValueError as err:
        raise ConfigError(f"invalid config: system.availability_trace: {err}") from None
