"""The virtual clock: round time is the slowest selected client's round trip."""

import pytest

from fl.clock import MBIT, ClientWork, DeviceProfile, VirtualClock, build_profiles


def test_round_time_is_slowest_client():
    fast = DeviceProfile(speed=100.0, up_bytes_per_s=1000.0, down_bytes_per_s=2000.0)
    slow = DeviceProfile(speed=10.0, up_bytes_per_s=100.0, down_bytes_per_s=200.0)
    clock = VirtualClock([fast, slow], seed=0)
    work = [ClientWork(0, 100, 2000, 1000), ClientWork(1, 100, 2000, 1000)]
    # slow: 2000/200 + 100/10 + 1000/100 = 30 s; fast: 1 + 1 + 1 = 3 s
    assert clock.advance(work) == pytest.approx(30.0)
    assert clock.advance(work[:1]) == pytest.approx(3.0)
    assert clock.now == pytest.approx(33.0)


def test_uniform_profiles_are_identical_and_units_are_mbit():
    profiles = build_profiles(5, seed=1, speed=500, up_mbps=8, down_mbps=16)
    assert len(set(profiles)) == 1
    assert profiles[0].up_bytes_per_s == 8 * MBIT == 1e6


def test_heterogeneous_profiles_span_the_spread_and_are_seeded():
    a = build_profiles(
        200, seed=3, speed=500, up_mbps=10, down_mbps=50, speed_spread=20, bandwidth_spread=20
    )
    b = build_profiles(
        200, seed=3, speed=500, up_mbps=10, down_mbps=50, speed_spread=20, bandwidth_spread=20
    )
    assert a == b
    speeds = [p.speed for p in a]
    assert 10 <= max(speeds) / min(speeds) <= 20


def test_availability_is_a_seeded_draw_per_round():
    profiles = build_profiles(1000, seed=0, speed=1, up_mbps=1, down_mbps=1, availability=0.7)
    clock = VirtualClock(profiles, seed=0)
    first = clock.available(1, range(1000))
    assert first == clock.available(1, range(1000))
    assert first != clock.available(2, range(1000))
    assert 0.65 < len(first) / 1000 < 0.75
