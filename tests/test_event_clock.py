"""The event-driven virtual clock: shared server link, compute traces, availability, resume."""

import io
import json
import math

import pytest
import torch

from fl.world.clock import (
    MBIT,
    Arrival,
    AvailabilityTrace,
    DeviceProfile,
    Job,
    SpeedTrace,
    VirtualClock,
    build_profiles,
    clock_from_config,
)

FAST = 1e12  # a client link far faster than any server link in these tests


def drain(clock: VirtualClock) -> list[Arrival]:
    """Every remaining completion, in the order the clock returns them."""
    out = []
    while (arrival := clock.next_arrival()) is not None:
        out.append(arrival)
    return out


def upload_only(key: int, partition: int, size: int) -> Job:
    return Job(key, partition, 0, 0, ((1.0, size),))


# ----- one client: the closed forms ----------------------------------------------------
def _pipelined(
    profile: DeviceProfile, down: int, step_s: float, groups: list[tuple[int, int]], extra: int
) -> float:
    """Groups `(step, bytes)` leave in order once their step is done, one at a time on the
    uplink while training goes on; `extra` bytes follow the last (PAS's schedule)."""
    start = down / profile.down_bytes_per_s
    free = start
    for step, size in sorted(groups):
        free = max(free, start + step * step_s) + size / profile.up_bytes_per_s
    return free + extra / profile.up_bytes_per_s


def test_lone_job_takes_the_sequential_time():
    profiles = build_profiles(
        8, seed=4, speed=37.3, up_mbps=0.3, down_mbps=1.7, speed_spread=9, bandwidth_spread=9
    )
    for p, profile in enumerate(profiles):
        clock = VirtualClock(profiles, seed=0, now=3.25)
        clock.submit(Job(11, p, 40_000, 300, ((1.0, 50_000),)))
        arrival = clock.next_arrival()
        assert arrival is not None and not arrival.dropped
        expected = profile.seconds(300, 40_000, 50_000)  # download, compute, upload
        assert arrival.arrived_s - 3.25 == pytest.approx(expected, rel=1e-12)
        assert arrival.downloaded_s - 3.25 == pytest.approx(40_000 / profile.down_bytes_per_s)
        assert arrival.computed_s == pytest.approx(arrival.downloaded_s + 300 / profile.speed)
        assert clock.now == arrival.arrived_s and clock.in_flight() == []


def test_pipelined_parts_match_pipelined_seconds():
    groups = [(0, 900), (2, 300), (5, 100), (5, 700)]
    batch, steps, extra = 32, 5, 250
    parts = (*((step / steps, size) for step, size in sorted(groups)), (1.0, extra))
    for up in (50.0, 5_000.0):  # the uplink, then compute, is the bottleneck
        profile = DeviceProfile(speed=100.0, up_bytes_per_s=up, down_bytes_per_s=400.0)
        clock = VirtualClock([profile], seed=0)
        clock.submit(Job(0, 0, 1_000, steps * batch, parts))
        arrival = clock.next_arrival()
        assert arrival is not None
        expected = _pipelined(profile, 1_000, batch / profile.speed, groups, extra)
        assert arrival.arrived_s == pytest.approx(expected, rel=1e-12)


def test_a_job_without_work_arrives_at_once_and_no_upload_ends_with_compute():
    clock = VirtualClock([DeviceProfile(10.0, 1.0, 1.0)], seed=0, now=5.0)
    clock.submit(Job(1, 0, 0, 0, ()))
    clock.submit(Job(2, 0, 0, 20, ()))
    assert clock.next_arrival() == Arrival(1, 0, 5.0, 5.0, 5.0, 5.0)
    assert clock.next_arrival() == Arrival(2, 0, 5.0, 5.0, 7.0, 7.0)
    assert clock.next_arrival() is None and clock.now == 7.0


# ----- the server's link ----------------------------------------------------------------
def test_equal_simultaneous_uploads_take_twice_as_long():
    clock = VirtualClock([DeviceProfile(1.0, FAST, FAST)] * 2, seed=0, server_bytes_per_s=1e3)
    clock.submit(upload_only(1, 0, 5_000))
    clock.submit(upload_only(2, 1, 5_000))
    first, second = drain(clock)
    assert (first.key, second.key) == (1, 2)  # a tie goes by key
    assert first.arrived_s == second.arrived_s == pytest.approx(2 * 5_000 / 1e3, rel=1e-12)


def test_staggered_uploads_follow_processor_sharing():
    size, capacity, t0 = 5_000, 1e3, 2.0
    clock = VirtualClock([DeviceProfile(1.0, FAST, FAST)] * 2, seed=0, server_bytes_per_s=capacity)
    clock.submit(upload_only(1, 0, size))
    assert clock.next_arrival(until=t0) is None and clock.now == t0
    clock.submit(upload_only(2, 1, size))
    first, second = drain(clock)
    # alone for t0, then half the link each: the first ends at 2B/S - t0, the second at 2B/S
    assert first.key == 1 and first.arrived_s == pytest.approx(2 * size / capacity - t0)
    assert second.arrived_s == pytest.approx(2 * size / capacity, rel=1e-12)
    assert second.sent_s == t0


def test_max_min_share_with_one_capped_flow():
    profiles = [DeviceProfile(1.0, 6.0, FAST), DeviceProfile(1.0, 100.0, FAST)]
    clock = VirtualClock([profiles[0], profiles[1], profiles[1]], seed=0, server_bytes_per_s=30)
    for key in range(3):
        clock.submit(upload_only(key, key, 60))
    arrivals = {a.key: a.arrived_s for a in drain(clock)}
    # the capped flow gets 6; the other two share the remaining 24 equally
    assert arrivals[1] == arrivals[2] == pytest.approx(60 / 12, rel=1e-12)
    assert arrivals[0] == pytest.approx(60 / 6, rel=1e-12)


def test_downloads_and_uploads_do_not_share_capacity():
    clock = VirtualClock([DeviceProfile(1.0, FAST, FAST)] * 2, seed=0, server_bytes_per_s=1e3)
    clock.submit(Job(1, 0, 4_000, 0, ()))
    clock.submit(upload_only(2, 1, 4_000))
    assert [a.arrived_s for a in drain(clock)] == pytest.approx([4.0, 4.0], rel=1e-12)


def test_wait_keeps_progress_and_returns_completions_in_time_order():
    profile = DeviceProfile(speed=100.0, up_bytes_per_s=1_000.0, down_bytes_per_s=2_000.0)
    clock = VirtualClock([profile] * 3, seed=0)
    clock.submit(Job(1, 0, 4_000, 300, ((1.0, 5_000),)))  # 2 + 3 + 5 = 10 s
    clock.wait(4.0)
    assert clock.now == 4.0 and clock.in_flight() == [1]
    assert clock.next_arrival().arrived_s == pytest.approx(10.0)  # type: ignore[union-attr]
    clock.submit(Job(3, 1, 0, 100, ((1.0, 1_000),)))  # arrives at 12
    clock.submit(Job(2, 2, 0, 200, ((1.0, 1_000),)))  # arrives at 13
    clock.wait(100.0)
    assert clock.now == 110.0 and clock.in_flight() == [2, 3]
    late = drain(clock)
    assert [(a.key, a.arrived_s) for a in late] == [(3, 12.0), (2, 13.0)]
    assert clock.now == 110.0  # never moves back


def test_cancel_frees_the_link_for_the_others():
    size, capacity, t0 = 5_000, 1e3, 4.0
    clock = VirtualClock([DeviceProfile(1.0, FAST, FAST)] * 2, seed=0, server_bytes_per_s=capacity)
    clock.submit(upload_only(1, 0, size))
    clock.submit(upload_only(2, 1, size))
    assert clock.next_arrival(until=t0) is None
    clock.cancel(1)
    assert clock.in_flight() == [2]
    (arrival,) = drain(clock)
    # half the link until t0, then all of it: t0 + (B - S t0 / 2) / S
    assert arrival.arrived_s == pytest.approx(t0 / 2 + size / capacity, rel=1e-12)
    with pytest.raises(KeyError):
        clock.cancel(1)


@pytest.mark.parametrize("server_bytes_per_s", [math.inf, 1e3])  # scheduled, or events
@pytest.mark.parametrize(("cancelled_at", "delivered"), [(4.9, False), (5.1, True)])
def test_cancel_says_whether_the_download_had_ended(
    server_bytes_per_s: float, cancelled_at: float, delivered: bool
) -> None:
    clock = VirtualClock(
        [DeviceProfile(10.0, 100.0, 100.0)], seed=0, server_bytes_per_s=server_bytes_per_s
    )
    clock.submit(Job(1, 0, 500, 100, ((1.0, 100),)))  # down 5 s, compute 10 s, up 1 s
    assert clock.next_arrival(until=cancelled_at) is None
    assert clock.cancel(1) is delivered
    assert clock.in_flight() == []


def test_until_duplicates_and_an_empty_clock():
    clock = VirtualClock([DeviceProfile(1.0, 1.0, 1.0)], seed=0)
    assert clock.next_arrival() is None and clock.now == 0.0
    assert clock.next_arrival(until=7.5) is None and clock.now == 7.5
    clock.submit(Job(1, 0, 10, 0, ()))
    with pytest.raises(ValueError, match="already in flight"):
        clock.submit(Job(1, 0, 10, 0, ()))
    assert clock.next_arrival(until=10.0) is None and clock.now == 10.0
    assert clock.next_arrival(until=17.5).arrived_s == 17.5  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="partition"):
        clock.submit(Job(2, 1, 10, 0, ()))


# ----- compute under background load ----------------------------------------------------
def test_constant_background_load_slows_compute():
    trace = SpeedTrace(0, mean=0.5, rho=0.0, sigma=0.0)
    clock = VirtualClock([DeviceProfile(100.0, 1.0, 1.0)], seed=0, speed_trace=trace)
    clock.submit(Job(1, 0, 0, 300, ()))
    assert clock.next_arrival().computed_s == pytest.approx(6.0)  # type: ignore[union-attr]
    assert clock.speed(0, 1e6) == 50.0


def test_speed_trace_is_seeded_and_order_independent():
    forward, backward, other = SpeedTrace(3), SpeedTrace(3), SpeedTrace(4)
    times = [60.0 * s + 1 for s in range(300)]
    ahead = [forward.multiplier(p, t) for p in (0, 9) for t in times]
    behind = [backward.multiplier(p, t) for p in (9, 0) for t in reversed(times)]
    assert ahead == [backward.multiplier(p, t) for p in (0, 9) for t in times]
    assert sorted(ahead) == sorted(behind)
    assert ahead != [other.multiplier(p, t) for p in (0, 9) for t in times]
    assert min(ahead) >= 0.05 and max(ahead) <= 1.0 and len(set(ahead)) > 100
    assert forward.multiplier(0, 60.0) == forward.multiplier(0, 119.9)  # one slot
    assert forward.next_change(60.0) == 120.0


def test_compute_integrates_speed_over_trace_slots():
    trace = SpeedTrace(7, slot_s=1.0, sigma=0.25)
    profile = DeviceProfile(100.0, 1e3, 1e3)
    clock = VirtualClock([profile], seed=0, speed_trace=trace)
    clock.submit(Job(1, 0, 500, 700, ()))  # download ends mid-slot, at 0.5 s
    arrival = clock.next_arrival()
    t, left = 0.5, 700.0
    while (rate := 100.0 * trace.multiplier(0, t)) * (trace.next_change(t) - t) < left:
        left -= rate * (trace.next_change(t) - t)
        t = trace.next_change(t)
    assert arrival is not None and arrival.computed_s == pytest.approx(t + left / rate, rel=1e-12)
    assert arrival.computed_s > 0.5 + 7.0  # slower than the dedicated device


# ----- availability ---------------------------------------------------------------------
BAD_TRACES = [
    ("{", "Expecting"),
    ('{"clients": []}', '"clients" object'),
    ('{"clients": {}, "when": 1}', "unknown keys"),
    ('{"clients": {"0": [[0, "a"]]}}', "finite numbers"),
    ('{"clients": {"0": [[-5, 10]]}}', "negative time"),
    ('{"clients": {"0": [[10, 5]]}}', "end must be after start"),
    ('{"clients": {"0": [[0, 10], [5, 20]]}}', "overlaps or precedes"),
    ('{"clients": {"0": [[10, 20], [0, 5]]}}', "overlaps or precedes"),
    ('{"clients": {"0": [[0, 10, 20]]}}', r"expected \[start, end\]"),
    ('{"clients": {"7": [[0, 10]]}}', "unknown client id '7'"),
    ('{"clients": {"x": [[0, 10]]}}', "unknown client id 'x'"),
    ('{"clients": {"01": [[0, 10]]}}', "unknown client id '01'"),
    ('{"period_s": 100, "clients": {"0": [[0, 150]]}}', "ends after period_s"),
    ('{"period_s": -1, "clients": {}}', "period_s must be a positive number"),
]


@pytest.mark.parametrize(("text", "problem"), BAD_TRACES)
def test_bad_availability_files_are_refused_by_name(tmp_path, text, problem):
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as caught:
        AvailabilityTrace.from_file(path, num_clients=5)
    assert str(path) in str(caught.value)


def test_missing_availability_file_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"trace\.json.*No such file"):
        AvailabilityTrace.from_file(tmp_path / "trace.json", num_clients=5)


def test_periodic_availability_wraps_around(tmp_path):
    path = tmp_path / "trace.json"
    clients = {"0": [[0, 10], [50, 80], [80, 100]], "2": [[20, 30]]}
    path.write_text(json.dumps({"period_s": 100, "clients": clients}))
    trace = AvailabilityTrace.from_file(path, num_clients=3)
    assert trace.online(0, 5) and not trace.online(0, 20) and trace.online(0, 105)
    assert trace.offline_from(0, 60) == 110.0  # [50, 100) then [100, 110): touching
    assert trace.offline_from(0, 30) == 30.0
    assert trace.online(1, 12345) and trace.offline_from(1, 0) == math.inf  # not in the file
    assert trace.offline_from(2, 225) == 230.0


def test_a_device_going_offline_drops_its_job(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"clients": {"0": [[0, 10]], "2": [[5, 100]]}}))
    trace = AvailabilityTrace.from_file(path, num_clients=3)
    profile = DeviceProfile(speed=10.0, up_bytes_per_s=100.0, down_bytes_per_s=100.0)
    clock = VirtualClock([profile] * 3, seed=0, availability_trace=trace)
    assert clock.available(1, range(3)) == [0, 1]
    clock.submit(Job(1, 0, 200, 200, ((1.0, 100),)))  # needs 2 + 20 + 1 s
    clock.submit(Job(2, 1, 200, 200, ((1.0, 100),)))  # never offline
    clock.submit(Job(3, 2, 200, 200, ((1.0, 100),)))  # offline now
    gone_now, dropped, done = drain(clock)
    assert gone_now == Arrival(3, 2, 0.0, math.inf, math.inf, 0.0, dropped=True)
    assert dropped == Arrival(1, 0, 0.0, 2.0, math.inf, 10.0, dropped=True)
    assert done == Arrival(2, 1, 0.0, 2.0, 22.0, 23.0)
    assert clock.available(1, range(3)) == [1, 2]


def test_seeded_availability_is_seeded_and_stationary():
    a = AvailabilityTrace.seeded(2000, 5, mean_online_s=300, mean_offline_s=100)
    b = AvailabilityTrace.seeded(2000, 5, mean_online_s=300, mean_offline_s=100)
    online = [a.online(p, 1000.0) for p in range(2000)]
    assert online == [b.online(p, 1000.0) for p in reversed(range(2000))][::-1]
    assert 0.7 < sum(online) / 2000 < 0.8
    ends = [a.offline_from(p, 1000.0) for p in range(50)]
    assert all(e >= 1000.0 and not a.online(p, e) for p, e in enumerate(ends))


# ----- resume ---------------------------------------------------------------------------
def _busy_clock() -> VirtualClock:
    profiles = build_profiles(
        40, seed=2, speed=80, up_mbps=0.2, down_mbps=0.5, speed_spread=5, bandwidth_spread=5
    )
    return VirtualClock(
        profiles,
        seed=2,
        server_bytes_per_s=0.6 * MBIT,
        speed_trace=SpeedTrace(2, slot_s=5.0, sigma=0.2),
        availability_trace=AvailabilityTrace.seeded(40, 2, mean_online_s=400, mean_offline_s=40),
    )


def _script(clock: VirtualClock, start: int, stop: int) -> list[Arrival]:
    """A fixed sequence of submissions, waits and arrivals; steps [start, stop)."""
    out: list[Arrival] = []
    for step in range(start, stop):
        for key in range(4 * step, 4 * step + 4):
            parts = ((0.5, 20_000 + key), (1.0, 30_000)) if key % 2 else ((1.0, 50_000),)
            clock.submit(Job(key, key % 40, 60_000, 200 + 7 * key, parts))
        for _ in range(3):
            if (arrival := clock.next_arrival(until=clock.now + 4.0)) is not None:
                out.append(arrival)
        clock.wait(0.75)
    return out


def test_state_dict_round_trip_mid_flight_is_bit_identical():
    whole = _busy_clock()
    first = _script(whole, 0, 6)
    whole.wait(3.0)
    state = whole.state_dict()
    assert state["jobs"] and state["arrived"]  # mid-flight, with completions not yet returned
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = _busy_clock()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.in_flight() == whole.in_flight() and resumed.now == whole.now
    rest = _script(whole, 6, 12) + drain(whole)
    assert rest == _script(resumed, 6, 12) + drain(resumed)
    assert whole.now == resumed.now
    assert any(a.dropped for a in first + rest) and any(not a.dropped for a in rest)


# ----- scale ----------------------------------------------------------------------------
def test_a_thousand_simultaneous_uploads_share_the_link():
    clock = VirtualClock([DeviceProfile(1.0, FAST, FAST)] * 1000, seed=0, server_bytes_per_s=1e6)
    for key in range(1000):
        clock.submit(upload_only(key, key, 10_000))
    arrivals = drain(clock)
    assert [a.key for a in arrivals] == list(range(1000))
    assert all(a.arrived_s == pytest.approx(1000 * 10_000 / 1e6, rel=1e-12) for a in arrivals)


def test_a_thousand_heterogeneous_jobs_all_arrive_in_time_order():
    profiles = build_profiles(
        1000, seed=1, speed=500, up_mbps=10, down_mbps=50, speed_spread=20, bandwidth_spread=20
    )
    clock = VirtualClock(profiles, seed=0, server_bytes_per_s=100 * MBIT)
    for key in range(1000):
        clock.submit(Job(key, key, 100_000, 2_000, ((1.0, 100_000),)))
    times = [a.arrived_s for a in drain(clock)]
    assert len(times) == 1000 and times == sorted(times)


# ----- configuration --------------------------------------------------------------------
UNIFORM = {
    "name": "uniform",
    "speed": 500.0,
    "up_mbps": 10.0,
    "down_mbps": 50.0,
    "availability": 1.0,
    "speed_spread": 1.0,
    "bandwidth_spread": 1.0,
}


def test_clock_from_config_reads_the_system_keys(tmp_path):
    plain = clock_from_config(UNIFORM, 4, seed=1)
    assert plain.server_bytes_per_s == math.inf
    assert plain.speed_trace is None and plain.availability_trace is None
    assert plain.profiles == build_profiles(4, seed=1, speed=500.0, up_mbps=10.0, down_mbps=50.0)
    off = {"server_bandwidth_mbps": None, "speed_trace": None, "trace_slot_s": 30.0}
    assert clock_from_config({**UNIFORM, **off}, 4, seed=1).speed_trace is None

    path = tmp_path / "trace.json"
    path.write_text('{"clients": {"1": [[0, 5]]}}')
    traced = {
        "server_bandwidth_mbps": 8.0,
        "speed_trace": "ar1",
        "trace_slot_s": 30.0,
        "load_mean": 0.2,
        "load_sigma": None,
        "availability_trace": str(path),
    }
    clock = clock_from_config({**UNIFORM, **traced}, 4, seed=1)
    assert clock.server_bytes_per_s == 1e6
    assert clock.speed_trace is not None and clock.speed_trace.slot_s == 30.0
    assert (clock.speed_trace.mean, clock.speed_trace.sigma) == (0.2, 0.1)
    assert clock.available(1, range(4)) == [0, 1, 2, 3]
    clock.wait(6.0)
    assert clock.available(1, range(4)) == [0, 2, 3]  # the trace, not the Bernoulli draw
    seeded = {"availability_trace": "seeded", "mean_online_s": 60, "mean_offline_s": 20}
    assert clock_from_config({**UNIFORM, **seeded}, 4, seed=1).availability_trace is not None


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"bandwith_mbps": 3}, "unknown system options: \\['bandwith_mbps'\\]"),
        ({"speed_trace": "gauss"}, "'ar1', 'toggle' or null"),
        ({"availability_trace": "seeded"}, "seeded needs"),
        ({"speed_trace": "ar1", "load_rho": 2.0}, "rho must be in"),
    ],
)
def test_clock_from_config_refuses_bad_keys(extra, problem):
    with pytest.raises(ValueError, match=problem):
        clock_from_config({**UNIFORM, **extra}, 4, seed=1)


def test_submitting_a_round_at_once_is_submitting_it_job_by_job():
    """`submit_many` (the loop's one call a round) grows the table once; every arrival,
    drop and phase time is what submitting the jobs one by one gives, on a shared server
    link with a speed trace and availability."""
    profiles = build_profiles(
        12, seed=2, speed=40.0, up_mbps=0.5, down_mbps=2.0, speed_spread=4, bandwidth_spread=4
    )
    parts = ((0.5, 9_000), (1.0, 20_000))
    jobs = [
        Job(100 + p, p, 0 if p % 5 == 0 else 30_000 + 977 * p, (p % 4) * 50, parts)
        for p in range(12)
    ]

    def clock() -> VirtualClock:
        return VirtualClock(
            profiles,
            seed=1,
            now=2.0,
            server_bytes_per_s=0.4 * MBIT,
            speed_trace=SpeedTrace(3, slot_s=1.5, sigma=0.3),
            availability_trace=AvailabilityTrace.seeded(12, 5, mean_online_s=40, mean_offline_s=5),
        )  # fmt: skip

    one_by_one, at_once = clock(), clock()
    for job in jobs:
        one_by_one.submit(job)
    at_once.submit_many(jobs)
    assert at_once.state_dict() == one_by_one.state_dict()
    arrivals = drain(at_once)
    assert arrivals == drain(one_by_one)
    assert len(arrivals) == 12 and {a.dropped for a in arrivals} == {True, False}
    with pytest.raises(ValueError, match="already in flight"):
        clock().submit_many([jobs[0], jobs[0]])


def _independent_script(clock: VirtualClock) -> list[Arrival]:
    """Three waves of jobs that cannot meet (some two-part, which stay on the event table),
    with waits, deadlines and a cancel in between."""
    out: list[Arrival] = []
    for wave in range(3):
        jobs = []
        for p in range(40):
            key = 100 * wave + p
            parts: tuple[tuple[float, int], ...] = ((1.0, 0 if p % 7 == 0 else 9_000 + 31 * p),)
            if p % 9 == 0:
                parts = ((0.5, 4_000), (1.0, 5_000))
            elif p % 11 == 0:
                parts = ()
            down = 0 if p % 5 == 0 else 20_000 + 577 * p
            jobs.append(Job(key, p, down, 0 if p % 6 == 0 else 40 + 13 * p, parts))
        clock.submit_many(jobs)
        for _ in range(15):
            if (arrival := clock.next_arrival(until=clock.now + 0.4)) is not None:
                out.append(arrival)
        clock.wait(0.3)
        clock.cancel(100 * wave + 39)
    return out + drain(clock)


def test_jobs_that_cannot_meet_are_scheduled_as_their_events_would_end_them(monkeypatch):
    """With no shared link and no traces, a job that uploads once at the end gets its
    arrival at submit; every phase time and the order of arrivals, ties included, equal
    the event simulation's float for float, and a checkpoint taken mid-flight resumes."""
    profiles = build_profiles(
        40, seed=3, speed=60.0, up_mbps=0.8, down_mbps=3.0, speed_spread=5, bandwidth_spread=5
    )
    profiles = profiles[:20] + profiles[:20]  # equal devices: simultaneous arrivals tie

    def clock() -> VirtualClock:
        return VirtualClock(profiles, seed=1, now=1.25)

    scheduled = _independent_script(clock())
    with monkeypatch.context() as patched:
        patched.setattr(VirtualClock, "_independent", property(lambda self: False))
        events = _independent_script(clock())
    assert scheduled == events
    assert len({a.arrived_s for a in scheduled}) < len(scheduled)  # ties were exercised

    whole = clock()
    whole.submit_many([Job(k, k, 10_000, 50 + k, ((1.0, 8_000),)) for k in range(40)])
    whole.submit_many([Job(40 + k, k, 0, 30, ((0.5, 1_000), (1.0, 2_000))) for k in range(3)])
    whole.wait(1.0)
    state = whole.state_dict()
    assert state["scheduled"] and state["jobs"]
    resumed = clock()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.in_flight() == whole.in_flight()
    assert drain(resumed) == drain(whole)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("arrived_s", math.nan),
        ("arrived_s", 0.5),  # before the saved `now`: not yet to come
        ("partition", 40),  # no such device
        ("computed_s", 1e9),  # after its own arrival
        ("key", 3),  # a key already in flight
        ("dropped", True),
    ],
)
def test_a_tampered_checkpoint_arrival_is_refused(field, value):
    """The clock's saved arrivals come from a file: each is checked before it is kept."""
    profiles = build_profiles(40, seed=3, speed=60.0, up_mbps=0.8, down_mbps=3.0)
    clock = VirtualClock(profiles, seed=1, now=1.25)
    clock.submit_many([Job(k, k, 10_000, 50 + k, ((1.0, 8_000),)) for k in range(4)])
    state = json.loads(json.dumps(clock.state_dict()))
    resumed = VirtualClock(profiles, seed=1)
    resumed.load_state_dict(state)  # as saved: taken
    assert resumed.in_flight() == [0, 1, 2, 3]
    state["scheduled"][0][field] = value
    with pytest.raises(ValueError, match="clock state"):
        VirtualClock(profiles, seed=1).load_state_dict(state)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("now",), math.nan),
        (("key",), "9"),
        (("partition",), 40),  # no such device
        (("samples",), -1),
        (("uploads",), [[1.5, 8_000]]),  # more than the whole update
        (("uploads",), [[1.0, 8_000], [0.5, 10]]),  # parts out of order
        (("sent_s",), 9.0),  # sent after the saved `now`
        (("downloaded_s",), math.nan),
        (("downloaded_s",), 0.5),  # before it was sent
        (("part",), 2),  # past its last upload part
        (("sending",), 1),
        (("drop_s",), math.nan),
        (("download", "rate"), -1.0),
        (("compute", "done"), 1e6),  # past its goal
        (("compute", "since"), math.inf),
        (("upload", "end"), 0.0),  # ends before it began
        (("upload",), {"done": 0.0}),  # a field missing
    ],
)
def test_a_tampered_checkpoint_job_in_flight_is_refused(path, value):
    """The clock's jobs in flight come from a file too: each is checked before it is kept."""
    profiles = build_profiles(40, seed=3, speed=60.0, up_mbps=0.8, down_mbps=3.0)
    shared = {"seed": 1, "server_bytes_per_s": 1e5}  # a shared link: jobs stay in flight
    clock = VirtualClock(profiles, now=1.25, **shared)
    clock.submit_many([Job(k, k, 10_000, 50 + k, ((1.0, 8_000),)) for k in range(4)])
    clock.wait(0.5)
    state = json.loads(json.dumps(clock.state_dict()))
    assert len(state["jobs"]) == 4
    resumed = VirtualClock(profiles, **shared)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as saved: taken
    assert resumed.in_flight() == clock.in_flight()
    target = state if path == ("now",) else state["jobs"][0]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match="clock state"):
        VirtualClock(profiles, **shared).load_state_dict(state)
