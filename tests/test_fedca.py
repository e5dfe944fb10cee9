"""FedCA on hand-made cases (metric, utility, T_R, early stop, eager layers, re-sends, the
toggling clock) and end to end on the time-varying system."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import read_metrics, run_fl, without_wall_time
from flwr.app import ConfigRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from torch import nn

from clients.trainer import TrainSettings, train_locally
from fl.mechanisms.diagnosis import LinearityTest
from fl.strategy.client import ClientTime
from fl.strategy.server import ClientUpdate, ReplyInfo
from fl.wire.codec import decode, encode_dense, payload_traffic
from fl.wire.records import Layout
from fl.world.clock import (
    DeviceProfile,
    Job,
    ToggleTrace,
    VirtualClock,
    build_profiles,
    clock_from_config,
)
from strategies.fedca import (
    FedCAHooks,
    FedCAParams,
    FedCAServer,
    Profile,
    eager_steps,
    net_utility,
    progress_curve,
    round_time,
)
from strategies.fedca_plus import EagerLinearity, eagerly_stable


def test_progress_metric_is_cosine_times_norm_ratio():
    updates = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [4.0, 4.0], [2.0, 2.0]])
    # G_K = (2, 2): (1, 0) has cos 1/√2 and norm ratio 1/(2√2); (4, 4) overshoots by 2x
    expected = [0.0, 0.25, 0.5, 0.5, 1.0]
    assert progress_curve(updates).tolist() == pytest.approx(expected)
    assert progress_curve(-updates)[-1] == pytest.approx(1.0)
    assert progress_curve(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))[0] == pytest.approx(-1.0)


def test_utility_is_benefit_minus_time_cost_of_equations_2_to_4():
    curve = torch.tensor([0.0, 0.5, 0.8, 0.9, 1.0])  # K = 4
    # τ = 3: gain 0.1, average remaining (1 - 0.9) / 1; cost β t / T_R = 0.01 * 1 / 10
    assert net_utility(curve, 3, 1.0, 10.0, 0.01) == pytest.approx(0.1 - 0.001)
    # past T_R the cost weight jumps from β to 1
    assert net_utility(curve, 3, 11.0, 10.0, 0.01) == pytest.approx(0.1 - 1.1)
    # a plateau: the floor (1 - P_τ) / (K - τ) is the benefit
    flat = torch.tensor([0.0, 0.9, 0.91, 0.92, 1.0])
    assert net_utility(flat, 2, 0.0, 10.0, 0.01) == pytest.approx((1 - 0.91) / 2)
    assert net_utility(flat, 4, 5.0, 10.0, 0.1) == pytest.approx(0.08 - 0.05)  # τ = K


def test_round_time_maximises_clients_done_per_second():
    assert round_time([1.0, 1.5, 1.6, 10.0]) == 1.6  # 3 / 1.6 beats 1, 2 / 1.5, 4 / 10
    assert round_time([2.0, 2.0, 30.0]) == 2.0
    assert math.isinf(round_time([]))


def test_eager_step_is_the_first_iteration_past_t_e_before_the_end():
    curves = torch.tensor([[0, 0.5, 0.96, 0.97, 1.0], [0, 0.1, 0.2, 0.3, 1.0]])
    assert eager_steps(curves, 0.95) == [2, 0]  # the second only reaches 1 at K: not eager


# ----- the client half on a tiny model ---------------------------------------------------
class Round:
    """FedCA's client hooks on a tiny linear model, loaded and begun as the app does."""

    def __init__(
        self, params: FedCAParams, profile: Profile | None, outputs: int, speed: float
    ) -> None:
        self.hooks, self.state = FedCAHooks(params), RecordDict()
        if profile is not None:
            profile.save(self.state)
        self.hooks.time = ClientTime(speed=speed)
        self.model = nn.Linear(2, outputs)
        self.layout = Layout.of(self.model.state_dict())
        sent = encode_dense(self.layout.flatten(self.model.state_dict()), self.layout)
        self.hooks.load(self.model, RecordDict(dict(sent)), self.state, self.layout)
        server_round = 1 if profile is None else profile.round + 1
        config = ConfigRecord({"server-round": server_round, "fedca-round-s": 0.45})
        self.hooks.begin(self.model, config, self.state)

    def train(self, steps: int) -> int:
        x = torch.randn(32, 2)
        y = torch.randint(0, self.model.out_features, (32,))
        settings = TrainSettings(local_steps=steps, local_epochs=1, batch_size=1, lr=0.01)
        return train_locally(self.model, x, y, self.hooks, settings).steps


def _round(variant: str, curve: list[float], layers: list[list[float]], speed: float) -> Round:
    """A round after an anchor with the given curves, T_R = 0.45 s, a 2-tensor model."""
    params = FedCAParams(variant=variant, local_steps=len(curve) - 1, beta=0.01)
    profile = Profile(1, torch.tensor(curve).double(), torch.tensor(layers).double())
    return Round(params, profile, 1, speed)


LINEAR = [i / 10 for i in range(11)]  # benefit 0.1 every iteration: only T_R stops it


def test_early_stop_exactly_when_the_utility_turns_negative():
    # 10 samples/s, batch 1: after s steps t = 0.1 s; T_R = 0.45 s, so the first check
    # with t > T_R (cost 0.5 / 0.45 > 0.1) is after step 5
    assert _round("v1", LINEAR, [LINEAR, LINEAR], speed=10.0).train(10) == 5
    # no deadline pressure (T_R far away): the full K iterations
    assert _round("v1", LINEAR, [LINEAR, LINEAR], speed=1e6).train(10) == 10
    # a plateau stops well before T_R: at iteration τ = s + 1 the benefit is the floor
    # 1e-4 (11 - τ) / (10 - τ), the cost β (s ms) / T_R: 1.5e-4 < 1.56e-4 first at s = 7
    plateau = [0.0] + [0.999 + 1e-4 * i for i in range(9)] + [1.0]
    stop = _round("v1", plateau, [plateau, plateau], speed=1000.0).train(10)  # 1 ms a step
    assert stop == 7
    curve = torch.tensor(plateau)
    assert net_utility(curve, stop + 1, stop / 1000, 0.45, 0.01) < 0
    assert net_utility(curve, stop, (stop - 1) / 1000, 0.45, 0.01) >= 0


def test_anchor_round_trains_all_iterations_and_profiles():
    anchor = Round(FedCAParams(local_steps=10), None, 2, speed=1.0)
    assert anchor.hooks.anchor and anchor.train(10) == 10  # T_R long passed: no optimisation
    _, metrics = anchor.hooks.end(anchor.model, anchor.state, anchor.layout)
    profile = Profile.load(anchor.state)
    assert metrics == {"fedca-anchor": 1} and profile is not None and profile.round == 1
    assert profile.model.shape == (11,) and profile.layers.shape == (2, 11)
    assert profile.layers[:, -1].tolist() == pytest.approx([1.0, 1.0])
    assert profile.model[-1] == pytest.approx(1.0) and profile.model[0] == 0.0


def _eager_round(variant: str) -> tuple[FedCAHooks, RecordDict, torch.Tensor, torch.Tensor]:
    """Both layers leave after step 1; the weight then turns around, the bias goes on."""
    eager = [0.0, 0.97, 0.98, 1.0]
    run = _round(variant, [0.0, 0.5, 0.8, 1.0], [eager, eager], speed=1e6)
    hooks, model, layout = run.hooks, run.model, run.layout
    start = hooks.start.clone()
    moves = [torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.0, 0.1, 0.1])]
    moves.append(torch.tensor([-2.0, 0.0, 0.0]))  # weight update now (-1, 0.1): cos < 0
    current = start.clone()
    for step, move in enumerate(moves, start=1):
        current += move
        layout.load_into(model, current)
        hooks.time.samples = step
        assert hooks.after_step(step, model, torch.tensor(0.0))
    reply, metrics = hooks.end(model, run.state, layout)
    content = RecordDict({**reply, "metrics": MetricRecord({**metrics, "samples": 3})})
    return hooks, content, start, current


def _metadata() -> Metadata:
    """A reply's metadata (only its source is read)."""
    return Metadata(
        run_id=0,
        message_id="",
        src_node_id=7,
        dst_node_id=0,
        reply_to_message_id="",
        group_id="2",
        created_at=0.0,
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )


def test_drifted_eager_layer_is_re_sent_and_settled_one_kept():
    hooks, content, start, final = _eager_round("v3")
    layout = hooks.layout
    got = decode(content, layout)
    assert torch.equal(got[:2], final[:2])  # weight: cos(G_F, G_eager) < T_r, re-sent
    assert got[2] == pytest.approx(float(start[2] + 0.5))  # bias: eager version kept
    drift = torch.nn.functional.cosine_similarity(
        (final[2:] - start[2:]).unsqueeze(0), torch.tensor([[0.5]])
    )
    assert float(drift) >= 0.6  # what the server keeps is within T_r of the final update
    metrics = content.metric_records["metrics"]
    assert metrics["fedca-resent"] == [1, 0] and metrics["fedca-eager-steps"] == [1, 1]
    # traffic: the dense model (3 floats) plus the re-sent weight's superseded copy
    assert payload_traffic(content).payload == 4 * 3 + 4 * 2
    # on the clock both layers leave after 1 of 3 samples; the re-send goes at the end
    server = FedCAServer(hooks.params, seed=0, clients_per_round=1)
    server.layout = layout
    reply = Message(content, metadata=_metadata())
    assert server.reply_parts(reply, 20) == ((1 / 3, 4), (1 / 3, 8), (1.0, 8))


def test_v2_keeps_eager_layers_without_re_send_and_v1_sends_none():
    hooks, content, start, final = _eager_round("v2")
    got = decode(content, hooks.layout)
    assert got[:2].tolist() == pytest.approx((start[:2] + torch.tensor([1.0, 0.0])).tolist())
    assert content.metric_records["metrics"]["fedca-resent"] == [0, 0]
    assert payload_traffic(content).payload == 4 * 3
    plain, content, _, final = _eager_round("v1")
    assert torch.equal(decode(content, plain.layout), final)
    assert content.metric_records["metrics"]["fedca-eager-samples"] == [0, 0]


def test_eager_parts_arrive_earlier_on_the_clock():
    profile = DeviceProfile(speed=100.0, up_bytes_per_s=100.0, down_bytes_per_s=1e9)
    timings = []
    for parts in (((1.0, 200),), ((0.5, 150), (1.0, 50))):
        clock = VirtualClock([profile], seed=0)
        clock.submit(Job(0, 0, down_bytes=0, samples=200, uploads=parts))
        timings.append(clock.next_arrival().arrived_s)
    # compute ends at 2 s; 150 B leave at 1 s (on the wire until 2.5 s), then 50 B: 3 s
    assert timings == [pytest.approx(2 + 2), pytest.approx(2.5 + 0.5)]


# ----- the time-varying system -----------------------------------------------------------
def test_toggle_trace_is_seeded_order_free_and_bounded():
    a, b = ToggleTrace(3, 4), ToggleTrace(3, 4)
    times = [0.05 * i for i in range(400)]
    forward = [a.multiplier(p, t) for p in range(4) for t in times]
    backward = [b.multiplier(p, t) for p in reversed(range(4)) for t in reversed(times)]
    assert forward == [b.multiplier(p, t) for p in range(4) for t in times]
    assert sorted(backward) == sorted(forward)
    assert all(m == 1.0 or 0.2 <= m < 1.0 for m in forward)
    slow = sum(m < 1.0 for m in forward) / len(forward)
    assert 0.03 < slow < 0.3  # slow periods take 0.12 / (0.8 + 0.12) of the time
    t = 1.0
    change = a.next_change(t)
    assert change > t and any(a.multiplier(p, change) != a.multiplier(p, t) for p in range(4))
    between = (t + change) / 2
    assert all(a.multiplier(p, between) == a.multiplier(p, t) for p in range(4))


# system=time_varying's device options: log-normal speeds within 5x, fast/slow toggling
TIME_VARYING = {
    "speed": 20000.0,
    "up_mbps": 10.0,
    "down_mbps": 10.0,
    "speed_spread": 5.0,
    "speed_distribution": "lognormal",
    "speed_trace": "toggle",
}


def test_time_varying_system_wires_lognormal_speeds_and_toggles():
    options = TIME_VARYING
    clock = clock_from_config(options, 20, seed=0)
    speeds = [p.speed for p in clock.profiles]
    assert max(speeds) / min(speeds) <= 5.0 and isinstance(clock.speed_trace, ToggleTrace)
    assert sorted(speeds)[10] == pytest.approx(20000.0, rel=0.25)  # around the median
    default = build_profiles(4, seed=1, speed=500.0, up_mbps=1.0, down_mbps=1.0, speed_spread=20)
    assert default == build_profiles(
        4, seed=1, speed=500.0, up_mbps=1.0, down_mbps=1.0, speed_spread=20,
        speed_distribution="loguniform",
    )  # fmt: skip
    with pytest.raises(ValueError, match="speed_distribution"):
        build_profiles(2, seed=0, speed=1.0, up_mbps=1.0, down_mbps=1.0, speed_distribution="x")


# ----- end to end ------------------------------------------------------------------------
RUN = [
    "system=time_varying",
    "loop.first_k_fraction=0.9",
    "num_clients=10",
    "clients_per_round=10",
    "local_steps=50",
    "batch_size=16",
    "lr=0.05",
]


def _run(tmp, name, *extra, rounds=5, **kw):
    overrides = [*RUN, *extra, f"rounds={rounds}"]
    run_fl(tmp / name, *overrides, **kw)
    return read_metrics(tmp / name)


@pytest.mark.slow  # an end-to-end run with resume (~20 s); the mechanics have fast tests
def test_fedca_closes_at_the_earliest_90_percent_beats_fedavg_time_and_resumes(tmp_path):
    fedca = _run(tmp_path, "fedca", "strategy=fedca", "strategy.profile_every=3", fresh=True)
    fedavg = _run(tmp_path, "fedavg", "strategy=fedavg")
    assert all(r["replies"] == 9 and r["missing"] == 1 for r in fedca + fedavg)
    assert [r["anchors"] for r in fedca] == [9, 0, 0, 9, 0]
    tuned = [r for r in fedca if r["anchors"] == 0]
    assert all(math.isfinite(r["round_deadline_s"]) for r in fedca)
    assert any(s < 50 for r in tuned for s in r["stop_steps"])  # some stopped early
    assert all(len(r["stop_steps"]) == 9 for r in tuned)
    fedca_time = sum(r["round_time_s"] for r in tuned)
    fedavg_time = sum(fedavg[r["round"] - 1]["round_time_s"] for r in tuned)
    assert fedca_time < 0.97 * fedavg_time  # FedAvg: 0.1048 s a round; FedCA 7 % less
    assert fedca[-1]["accuracy"] > 0.5

    _run(tmp_path, "resumed", "strategy=fedca", "strategy.profile_every=3", rounds=3)
    resumed = _run(tmp_path, "resumed", "strategy=fedca", "strategy.profile_every=3", "resume=true")
    assert without_wall_time(resumed) == without_wall_time(fedca)


# ----- FedCA+ (our proposal) -------------------------------------------------------------
def test_fedca_plus_speculates_only_in_eagerly_stable_layers():
    replies = [
        {"fedca-eager-steps": [3, 0, 4], "fedca-resent": [0, 0, 1]},
        {"fedca-eager-steps": [2, 5, 4], "fedca-resent": [0, 0, 1]},
        {"fedca-eager-steps": [0, 0, 4], "fedca-resent": [0, 0, 0]},
    ]
    # layer 0 kept eager by 2 of 3, layer 1 by 1 of 3, layer 2 re-sent by 2 of 3
    assert eagerly_stable(replies, 3, 0.5) == [True, False, False]
    assert eagerly_stable(replies, 3, 0.3) == [True, True, True]
    assert eagerly_stable([], 3, 0.5) == [False, False, False]
    test = LinearityTest.fresh(4, 0.99)
    gated = EagerLinearity(test.ema, test.previous, test.seen, test.samples,
                           torch.tensor([True, True, False, False]))  # fmt: skip
    everywhere = torch.ones(4, dtype=torch.bool)
    for _ in range(4):  # a straight line: R = 0 where judged
        rate = gated.update(torch.full((4,), 0.5), everywhere)
    assert rate.tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.slow  # about 50 s of CPU: beyond the quick suite's share
def test_fedca_plus_run_speculates_without_rejections_and_resumes(tmp_path):
    extra = ("strategy=fedca_plus", "strategy.profile_every=3")
    plus = _run(tmp_path, "plus", *extra, rounds=4, fresh=True)
    assert all(r["rejected"] == 0 and r["replies"] == 9 for r in plus)
    assert plus[-1]["speculated_fraction"] > 0 and plus[-1]["eligible_fraction"] > 0
    assert plus[-1]["bytes_down"] < plus[0]["bytes_down"]  # speculated scalars stay home
    _run(tmp_path, "resumed", *extra, rounds=2)
    resumed = _run(tmp_path, "resumed", *extra, "resume=true", rounds=4)
    assert without_wall_time(resumed) == without_wall_time(plus)


# ----- the client's own clock and T_R from observed speeds (issue 35) ----------------------
def test_a_client_slowed_mid_round_stops_earlier_than_one_that_was_not():
    # benefit 0.1 an iteration, T_R = 0.45 s, batch 1, K = 10; both announce 20 samples/s
    steady = _round("v1", LINEAR, [LINEAR, LINEAR], speed=20.0)
    slowed = _round("v1", LINEAR, [LINEAR, LINEAR], speed=20.0)
    slowed.hooks.time = ClientTime(speed=20.0, speed_trace=((0.0, 20.0), (0.1, 4.0)))
    # steady: 0.05 s a step, 0.45 s after step 9: within T_R to the end
    assert steady.train(10) == 10
    # slowed to 4 samples/s after 0.1 s (2 steps): 0.6 s after step 4, past T_R: it stops
    assert slowed.train(10) == 4
    assert slowed.hooks.time.elapsed_s == pytest.approx(0.1 + 2 / 4.0)
    # the same client reading only the speed announced at the start would not have seen it
    blind = _round("v1", LINEAR, [LINEAR, LINEAR], speed=20.0)
    assert blind.train(10) == 10


def test_client_clock_follows_its_device_trace_as_the_virtual_clock_charges_it():
    options = TIME_VARYING
    slowed_any = False
    for partition in range(4):
        clock = clock_from_config(options, 4, seed=0)
        profile = clock.profiles[partition]
        segments = clock.speed_segments(partition, 0.0, math.inf)
        slowed_any |= len(segments) > 1
        samples, down = 60_000, 20_000  # seconds of compute: several toggles
        view = ClientTime(
            speed=segments[0][1],
            download_s=down / profile.down_bytes_per_s,
            samples=samples,
            speed_trace=tuple(segments),
        )
        clock.submit(Job(0, partition, down_bytes=down, samples=samples, uploads=()))
        assert view.elapsed_s == pytest.approx(clock.next_arrival().computed_s, rel=1e-9)
    assert slowed_any
    config = ConfigRecord(
        {
            "device-speed": 5.0,
            "device-up-bps": 1.0,
            "device-down-bps": 2.0,
            "deadline-s": 9.0,
            "device-speed-trace": [0.0, 5.0, 1.0, 1.0],
        }
    )
    view = ClientTime.from_config(config, down_bytes=2)
    assert view.speed_trace == ((0.0, 5.0), (1.0, 1.0))
    view.samples = 4  # 1 s of download, then 4 samples at 1/s: the second segment
    assert view.elapsed_s == pytest.approx(5.0)
    for bad in ([1.0, 5.0], [0.0, 5.0, 0.0, 1.0], [0.0, -1.0], [0.0]):
        config["device-speed-trace"] = bad
        with pytest.raises(ValueError, match="device-speed-trace"):
            ClientTime.from_config(config, down_bytes=2)


def test_round_time_comes_from_recently_observed_speeds_not_true_speeds():
    params = FedCAParams(local_steps=10, batch_size=10)  # 100 samples a full round
    server = FedCAServer(params, seed=0, clients_per_round=2)
    server.layout = Layout(("w",), ((1,),), (torch.float32,))
    server.global_vector = torch.zeros(1)
    fast = {"device-speed": 1e9, "device-up-bps": 1e12, "device-down-bps": 1e12}
    server.extra_config = lambda node: fast  # every device at full speed right now
    assert server.expected_s(1) == pytest.approx(100 / 1e9, rel=1e-3)  # nothing observed yet
    server.reply_info = {
        1: ReplyInfo(1, 0, arrived_s=2.0, base=torch.zeros(1), sent_s=0.0, compute_s=0.5),
        2: ReplyInfo(1, 0, arrived_s=3.0, base=torch.zeros(1), sent_s=0.0, compute_s=2.0),
    }
    updates = [
        ClientUpdate(1, torch.ones(1), 10, {"samples": 100}),  # 200 samples/s
        ClientUpdate(2, torch.ones(1), 10, {"samples": 40}),  # stopped early: 20 samples/s
    ]
    server.aggregate(1, updates)
    assert server.observed_speed == {1: 200.0, 2: 20.0}
    assert server.expected_s(1) == pytest.approx(0.5, rel=1e-6)
    assert server.expected_s(2) == pytest.approx(5.0, rel=1e-6)
    assert server.expected_s(3) == pytest.approx(0.5, rel=1e-6)  # unobserved: the median
    server.select(2, [1, 2])
    assert server.round_s == pytest.approx(0.5, rel=1e-6)  # 1 / 0.5 beats 2 / 5
