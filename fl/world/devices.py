"""Device profiles: each client's compute speed, up/down bandwidth and availability.

Drawn once per run from the `system` group (`build_profiles`: log-uniform or log-normal
spreads around a median, seeded), held as columns (`Profiles`) so a million clients cost
four arrays, and read by the virtual clock (`fl.world.clock`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

__all__ = ["MBIT", "SPEED_DISTRIBUTIONS", "DeviceProfile", "Profiles", "build_profiles"]

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
