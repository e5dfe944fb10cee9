"""Device profiles and availability; event timing is in test_event_clock.py."""

import pytest

from fl.world.clock import MBIT, DeviceProfile, Job, VirtualClock, build_profiles


def test_replies_arrive_in_order_of_their_round_trips():
    fast = DeviceProfile(speed=100.0, up_bytes_per_s=1000.0, down_bytes_per_s=2000.0)
    slow = DeviceProfile(speed=10.0, up_bytes_per_s=100.0, down_bytes_per_s=200.0)
    clock = VirtualClock([fast, slow], seed=0)
    for key in (0, 1):
        clock.submit(Job(key, key, down_bytes=2000, samples=100, uploads=((1.0, 1000),)))
    # fast: 2000/2000 + 100/100 + 1000/1000 = 3 s; slow: 10 + 10 + 10 = 30 s
    first, second = clock.next_arrival(), clock.next_arrival()
    assert (first.key, first.arrived_s) == (0, pytest.approx(3.0))
    assert (second.key, second.arrived_s) == (1, pytest.approx(30.0))
    assert clock.now == pytest.approx(30.0) and clock.next_arrival() is None


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
