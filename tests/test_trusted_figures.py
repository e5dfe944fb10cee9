"""Figures from untrusted replies: bytes as received, time as asked, ε by the server.

Each run here is the real round loop on the in-process engine, with a ClientApp mod that
tampers with one client's reply after it trained (partition 0), as a hostile client would.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_metrics
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import clients.app as client
from fl.common.config import ConfigError, compose, to_run_config
from fl.common.errors import RunError
from fl.run.engines.local import LocalGrid
from fl.run.loops import WorkBounds
from fl.run.validation import validate
from fl.strategy.server import ServerStrategy
from fl.wire.codec import Traffic, encode_dense, encode_masked, payload_traffic
from fl.wire.records import Layout, numpy_to_array
from fl.world.task import get_task
from privacy.central import CentralDP, wrap_central_dp
from privacy.dpsgd import DPSGD
from server.loop import _asked_samples, _Work, run_training
from strategies.fedavg import FedAvgParams

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")

RUN = ["num_clients=4", "clients_per_round=4", "local_epochs=1", "progress=false"]
DENSE = 4810 * 4  # the digits MLP, float32
Tamper = Callable[[RecordDict], None]


def _run(out: Path, overrides: list[str], tamper: Tamper | None = None) -> tuple[list, dict]:
    """The round loop on a LocalGrid whose partition 0 hands its replies to `tamper`."""

    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        reply = call_next(msg, context)
        hostile = int(context.node_config["partition-id"]) == 0
        if tamper and hostile and msg.metadata.message_type == "train" and reply.has_content():
            tamper(reply.content)
        return reply

    app = ClientApp(mods=[mod])
    app.query("info")(client.info)
    app.train()(client.train)
    cfg = compose([*RUN, *overrides])
    summary = run_training(LocalGrid(app, cfg.num_clients, to_run_config(cfg)), cfg, out)
    return read_metrics(out), summary


def _set_metric(key: str, value: Any) -> Tamper:
    def tamper(content: RecordDict) -> None:
        content["metrics"] = MetricRecord({**content.metric_records["metrics"], key: value})

    return tamper


# ----- bytes: as received ----------------------------------------------------------------
@pytest.mark.parametrize("claimed", [2**28, 2**38])
def test_a_rejected_reply_claiming_huge_arrays_counts_the_bytes_that_arrived(tmp_path, claimed):
    def forge(content: RecordDict) -> None:  # 16 bytes that claim `claimed` float32 scalars
        content["arrays"] = ArrayRecord(
            {"w": Array("float32", (claimed,), "numpy.ndarray", b"0" * 16)}
        )

    rows, _ = _run(tmp_path, ["rounds=1"], forge)
    assert rows[0]["rejected"] == 1
    assert rows[0]["bytes_up"] == 3 * DENSE + 16  # three honest replies and what arrived
    assert rows[0]["bytes_down"] == 4 * DENSE


def test_traffic_is_measured_from_the_arrays_never_taken_from_the_codec_record():
    state = {"w": torch.ones(3, 4), "steps": torch.tensor(7)}  # an int64 buffer: 8 B
    layout = Layout.of(state)
    content = RecordDict(encode_dense(layout.flatten(state), layout))
    assert payload_traffic(content) == Traffic(12 * 4 + 8)
    content["codec"] = ConfigRecord({"name": "dense", "payload-bytes": 0, "control-bytes": 0})
    assert payload_traffic(content) == Traffic(12 * 4 + 8)  # an understatement changes nothing
    shipped = RecordDict(encode_masked(torch.arange(16.0), torch.arange(16) < 6, ship_mask=True))
    assert payload_traffic(shipped) == Traffic(6 * 4, 2)  # values, and the bitmap as control
    junk = numpy_to_array(torch.zeros(10, dtype=torch.uint8).numpy())
    shipped["padding"] = ArrayRecord({"junk": junk})
    assert payload_traffic(shipped) == Traffic(6 * 4, 2 + 10)  # every array that arrived


# ----- time: as asked ----------------------------------------------------------------------
def test_a_reply_claiming_more_samples_than_asked_is_charged_what_was_asked(tmp_path):
    honest, _ = _run(tmp_path / "honest", ["rounds=2"])
    inflated, _ = _run(tmp_path / "inflated", ["rounds=2"], _set_metric("samples", 10**15))
    assert [r["replies"] for r in inflated] == [4, 4]
    for key in ("round_time_s", "virtual_time_s"):
        assert [r[key] for r in inflated] == [r[key] for r in honest]
    assert honest[-1]["virtual_time_s"] < 60


def test_a_reply_claiming_no_samples_gets_no_free_time(tmp_path):
    honest, _ = _run(tmp_path / "honest", ["rounds=2"])
    idle, _ = _run(tmp_path / "idle", ["rounds=2"], _set_metric("samples", 0))
    assert [r["replies"] for r in idle] == [4, 4]
    for key in ("round_time_s", "virtual_time_s"):
        assert [r[key] for r in idle] == [r[key] for r in honest]


LBBSP = [
    "strategy=lbbsp",
    "local_steps=3",
    "local_epochs=1",
    "batch_size=16",
    "partition=iid",
    "system=heterogeneous",
    "system.speed_spread=4",
    "rounds=3",
]


def test_lbbsp_measures_throughput_on_the_clock_so_a_lie_buys_no_batch(tmp_path):
    """A client reporting compute-s=1e-6 (a million-fold speed) took nearly the whole
    global batch; the span the server observes on the clock ignores the report."""
    honest, _ = _run(tmp_path / "honest", LBBSP)
    lying, _ = _run(tmp_path / "lying", LBBSP, _set_metric("compute-s", 1e-6))
    keys = ("batch_min", "batch_max", "batch_total", "virtual_time_s", "accuracy")
    assert [[r[k] for k in keys] for r in lying] == [[r[k] for k in keys] for r in honest]
    assert honest[1]["batch_min"] < 16 < honest[1]["batch_max"]  # sized from round 1: not BSP


def test_lbbsp_holds_a_reported_compute_time_within_the_round_trip_on_real_arrivals():
    from fl.strategy.updates import ClientUpdate, ReplyInfo
    from strategies.lbbsp import HINT_FLOOR, LBBSPParams, LBBSPServer

    server = LBBSPServer(LBBSPParams(), seed=0, clients_per_round=1)

    def measured(reported: float, compute_s: float | None = None) -> float:
        base = torch.zeros(3)
        server.reply_info = {7: ReplyInfo(1, 0, 12.0, base, sent_s=10.0, compute_s=compute_s)}
        update = ClientUpdate(7, base, 10, {"samples": 10, "compute-s": reported})
        return server.check_update(update).metrics["compute-s"]

    assert measured(1e-6) == HINT_FLOOR * 2.0  # a lie is held to half the round trip
    assert measured(1.2) == 1.2  # an honest hint within the round trip stands
    assert measured(50.0) == 2.0  # never more than the round trip
    assert measured(1e-6, compute_s=0.7) == 0.7  # the clock's span, whatever the report
    with pytest.raises(ValueError, match="positive"):
        measured(float("nan"))


def _bounds(cfg, node: int, work: _Work | None = None, **keys: int) -> WorkBounds:
    config = ConfigRecord({"server-round": 1, **{k.replace("_", "-"): v for k, v in keys.items()}})
    work = work or _Work(cfg.local_steps, cfg.batch_size, cfg.local_epochs)
    message = Message(RecordDict({"config": config}), node, "train")
    return _asked_samples(message, work, get_task(cfg), {101: 0, 102: 1})


def test_the_samples_asked_follow_the_round_keys_a_strategy_sends():
    cfg = compose([*RUN, "local_epochs=2"])
    sizes = [len(p) for p in get_task(cfg).partitions]

    def asked(node: int, **keys: int) -> int:
        return _bounds(cfg, node, **keys).high

    assert asked(101) == 2 * sizes[0] and asked(102) == 2 * sizes[1]
    assert asked(101, local_epochs=1) == sizes[0]
    assert asked(101, local_steps=3) == 3 * 32  # GIFT's per-round steps, the run's batch size
    assert asked(102, local_steps=3, batch_size=5) == 15


def test_the_least_work_charged_is_what_an_honest_trainer_does():
    cfg = compose([*RUN, "local_epochs=2"])
    n = len(get_task(cfg).partitions[0])
    assert _bounds(cfg, 101) == WorkBounds(2 * n, 2 * n)  # epochs: every example, each pass
    # steps: a pass's last batch holds what is left (n = 7 * 32 + r: 8 steps a pass)
    per_pass = -(-n // 32)
    steps = per_pass + 2
    assert _bounds(cfg, 101, local_steps=steps) == WorkBounds(n + 2 * 32, steps * 32)
    assert _bounds(cfg, 101, local_steps=3, batch_size=10 * n).low == 3 * n  # batch > data
    early = _Work(0, 32, 2, min_steps=1)  # FedCA: a client may stop after one step
    assert _bounds(cfg, 101, early) == WorkBounds(min(32, n), 2 * n)
    poisson = _Work(0, 32, 2, random_batches=True)  # DP-SGD: any count is honest
    assert _bounds(cfg, 101, poisson) == WorkBounds(0, 2 * n)


# ----- ε: the server's accountant ---------------------------------------------------------
def test_epsilon_comes_from_the_servers_accountant_not_the_reply(tmp_path, caplog):
    dp_run = ["rounds=2", "privacy=dpsgd", "local_steps=2"]
    _, honest = _run(tmp_path / "honest", dp_run)
    with caplog.at_level(logging.INFO, logger="privacy.rounds"):
        rows, lying = _run(tmp_path / "lying", dp_run, _set_metric("epsilon", 0.0))
    cfg = compose([*RUN, *dp_run])
    dp = DPSGD.from_config(cfg)
    assert dp is not None
    sizes = [len(p) for p in get_task(cfg).partitions]
    expected = {str(p): dp.projected_epsilon(dp.plan(n), 2) for p, n in enumerate(sizes)}
    assert lying["epsilon_per_client"] == pytest.approx(expected, rel=1e-9)
    assert honest["epsilon_per_client"] == pytest.approx(expected, rel=1e-9)  # honest agrees
    assert lying["epsilon_max"] == pytest.approx(max(expected.values()), rel=1e-9)
    assert min(r["epsilon_max"] for r in rows) > 0
    assert "reports ε=0" in caplog.text


# ----- central DP: sensitivity and client-side copies ----------------------------------------
GLOBAL = {"w": torch.zeros(4, 5), "b": torch.zeros(5)}
LAYOUT = Layout.of(GLOBAL)
CLIP, SAMPLED = 0.5, 4


def _central(strategy: ServerStrategy) -> CentralDP:
    cfg = compose(
        [
            "privacy=central",
            f"clients_per_round={SAMPLED}",
            "privacy.server_dp.noise_multiplier=0.0",
            f"privacy.server_dp.clipping_norm={CLIP}",
        ]
    )
    wrapped = wrap_central_dp(strategy, cfg)
    assert isinstance(wrapped, CentralDP)
    return wrapped


def _aggregate(updates: dict[int, tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The noise-free central-DP aggregate when client i replies Δ_i with its example count."""
    strategy = _central(ServerStrategy(FedAvgParams(), seed=0, clients_per_round=SAMPLED))
    grid = LocalGrid(None, SAMPLED, {})  # type: ignore[arg-type]  # nodes are never called
    sent = list(strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), grid))
    replies = []
    for i, (delta, examples) in updates.items():
        records = {
            **encode_dense(LAYOUT.flatten(GLOBAL) + delta, LAYOUT),
            "metrics": MetricRecord({"num-examples": examples, "train-loss": 1.0, "samples": 1}),
        }
        replies.append(Message(RecordDict(records), reply_to=sent[i]))
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None and strategy.stats.accepted == len(updates)
    return LAYOUT.flatten(arrays.to_torch_state_dict())


def test_one_client_moves_the_central_dp_aggregate_by_at_most_clip_over_sampled():
    torch.manual_seed(0)
    deltas = [torch.randn(LAYOUT.numel) * 10 for _ in range(SAMPLED)]  # all beyond the clip
    examples = [700, 10, 10, 10]  # example weighting would give client 0 a weight of 0.96
    everyone = _aggregate({i: (deltas[i], examples[i]) for i in range(SAMPLED)})
    for left_out in range(SAMPLED):
        rest = {i: (deltas[i], examples[i]) for i in range(SAMPLED) if i != left_out}
        moved = float(torch.linalg.vector_norm(everyone - _aggregate(rest)))
        assert moved == pytest.approx(CLIP / SAMPLED, rel=1e-4)  # ≤ C/n, as the noise assumes
    flipped = _aggregate({0: (-deltas[0], 700), **{i: (deltas[i], 10) for i in range(1, 4)}})
    assert float(torch.linalg.vector_norm(everyone - flipped)) <= 2 * CLIP / SAMPLED * 1.0001


def test_central_dp_refuses_a_strategy_whose_clients_keep_copies(monkeypatch):
    class Partial(ServerStrategy):  # sends only some scalars, like APF's masked pull
        def train_payload(self, server_round: int, node_id: int) -> dict[str, Any]:
            return encode_masked(self.global_vector, torch.arange(LAYOUT.numel) < 3, ship_mask=True)

    strategy = _central(Partial(FedAvgParams(), seed=0, clients_per_round=SAMPLED))
    grid = LocalGrid(None, SAMPLED, {})  # type: ignore[arg-type]
    with pytest.raises(RunError, match="'masked' payload"):
        strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), grid)

    monkeypatch.setattr(Partial, "central_dp_safe", False, raising=False)  # declared instead
    with pytest.raises(RunError, match="central DP cannot wrap Partial"):
        _central(Partial(FedAvgParams(), seed=0, clients_per_round=SAMPLED))


@pytest.mark.parametrize(
    ("overrides", "pair"),
    [
        (["strategy=apf", "privacy=central"], "privacy=central with strategy=apf"),
        (
            ["strategy=apf", "privacy=dpsgd", "privacy.server_dp.mode=fixed"],
            "privacy=dpsgd with strategy=apf",
        ),
        (["strategy=gift", "privacy=dpsgd", "local_steps=8"], "privacy=dpsgd with strategy=gift"),
        (["strategy=pas", "privacy=dpsgd", "local_steps=8"], "privacy=dpsgd with strategy=pas"),
    ],
)
def test_unsafe_privacy_and_strategy_pairs_are_refused_before_round_one(overrides, pair):
    with pytest.raises(ConfigError, match=pair) as refused:
        validate(compose(overrides))
    assert "\n" not in str(refused.value)


def test_safe_privacy_and_strategy_pairs_pass_validation():
    for overrides in (
        ["strategy=pas", "privacy=central", "local_steps=8"],
        ["strategy=gift", "privacy=central", "local_steps=8"],
        ["strategy=apf", "privacy=dpsgd"],
        ["strategy=fedprox", "privacy=dpsgd", "privacy.server_dp.mode=fixed"],
    ):
        validate(compose(overrides))


def test_central_dp_with_a_robust_aggregation_is_refused():
    with pytest.raises(ConfigError, match="needs aggregation=mean"):
        validate(compose(["privacy=central", "aggregation=median"]))


def test_a_metric_is_finite_only_without_nan_or_inf_in_it():
    from fl.strategy.updates import finite_metric

    for value in (0, 3, True, 1.5, -2.0, [], [1, 2], [0.5, 1e30], "text"):
        assert finite_metric(value), value
    for value in (math.nan, math.inf, -math.inf, [1.0, math.nan], [math.inf], [0.0, -math.inf]):
        assert not finite_metric(value), value
