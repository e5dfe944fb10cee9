"""Virtual clock: device and network heterogeneity made measurable on one machine.

Each client has a device profile (compute speed in samples/s, up/down bandwidth,
availability). Real training decides accuracy; the clock decides time: a synchronous
round lasts as long as its slowest selected client's download + compute + upload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ClientSeconds",
    "ClientWork",
    "DeviceProfile",
    "VirtualClock",
    "build_profiles",
    "pipelined_seconds",
    "sequential_seconds",
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


@dataclass(frozen=True)
class ClientWork:
    """What one client did in a round, as the clock needs it."""

    partition: int
    samples: int
    down_bytes: int
    up_bytes: int
    metrics: Mapping[str, Any] = field(default_factory=dict)  # the reply's metrics


ClientSeconds = Callable[[DeviceProfile, ClientWork], float]


def sequential_seconds(profile: DeviceProfile, work: ClientWork) -> float:
    """Download, then train, then upload: no overlap (FedAvg and most strategies)."""
    return profile.seconds(work.samples, work.down_bytes, work.up_bytes)


def _spread(rng: np.random.Generator, base: float, ratio: float, n: int) -> np.ndarray:
    """`n` values log-uniform in [base/sqrt(ratio), base*sqrt(ratio)]: max/min = ratio."""
    if ratio <= 1.0:
        return np.full(n, base)
    half = np.log(ratio) / 2
    return base * np.exp(rng.uniform(-half, half, n))


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
) -> list[DeviceProfile]:
    """Seeded profiles; a spread of 1 gives identical devices, 20 a 20x fastest/slowest gap."""
    rng = np.random.default_rng([seed, 0xC10C])
    speeds = _spread(rng, speed, speed_spread, num_clients)
    ups = _spread(rng, up_mbps * MBIT, bandwidth_spread, num_clients)
    downs = _spread(rng, down_mbps * MBIT, bandwidth_spread, num_clients)
    return [
        DeviceProfile(float(s), float(u), float(d), availability)
        for s, u, d in zip(speeds, ups, downs, strict=True)
    ]


class VirtualClock:
    """Simulated seconds since the start of training, advanced round by round."""

    def __init__(self, profiles: Sequence[DeviceProfile], seed: int, now: float = 0.0) -> None:
        self.profiles = list(profiles)
        self.seed = seed
        self.now = now

    def available(self, server_round: int, partitions: Iterable[int]) -> list[int]:
        """The partitions reachable in this round (a seeded draw per client and round)."""
        draws = np.random.default_rng([self.seed, server_round, 0xA7A1]).random(len(self.profiles))
        return [p for p in partitions if draws[p] < self.profiles[p].availability]

    def round_seconds(
        self, work: Iterable[ClientWork], client_seconds: ClientSeconds = sequential_seconds
    ) -> float:
        """Duration of a synchronous round: its slowest client's round trip.

        `client_seconds` lets a strategy that overlaps communication with computation
        (PAS, FedCA) say how long one client's round really takes.
        """
        return max((client_seconds(self.profiles[w.partition], w) for w in work), default=0.0)

    def advance(
        self,
        work: Iterable[ClientWork],
        client_seconds: ClientSeconds = sequential_seconds,
        at_least: float = 0.0,
    ) -> float:
        """Advance by one synchronous round; return its duration.

        `at_least` is the deadline the server waited for when some reply never came.
        """
        duration = max(self.round_seconds(work, client_seconds), at_least)
        self.now += duration
        return duration


def pipelined_seconds(
    profile: DeviceProfile,
    *,
    down_bytes: int,
    step_seconds: float,
    groups: Iterable[tuple[int, int]],
    extra_up_bytes: int = 0,
) -> float:
    """One client's round when parts of its upload leave before training ends.

    After the download, local steps run back to back; each group `(step, bytes)` may
    start uploading once local step `step` is done, and uploads share the client's
    uplink one after another, while computation goes on. `extra_up_bytes` (control
    state) follow the last group. The round ends when the last upload ends; with one
    group at the last step this is `sequential_seconds` (PAS eager synchronisation).
    """
    start = down_bytes / profile.down_bytes_per_s
    link_free = start
    for step, size in sorted(groups):
        link_free = max(link_free, start + step * step_seconds) + size / profile.up_bytes_per_s
    return link_free + extra_up_bytes / profile.up_bytes_per_s
