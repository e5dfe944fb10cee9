"""Cohort training (clients.cohort, engine.cohort=auto) against the per-client path.

Per step, the cohort's weights stay within `STEP_TOLERANCE` of `train_locally`'s on the
same batches; per cohort-safe strategy, a short run ends with the per-client run's metrics
within `METRIC_TOLERANCE` (rounds, replies, bytes and virtual time exactly); strategies
whose client half is not cohort-safe, DP-SGD and injected faults fall back and say so.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import train_in_process
from flwr.app import ConfigRecord, Context, Message, RecordDict
from torch import nn

from clients.cohort import METRIC_TOLERANCE, STEP_TOLERANCE, Member, cohort_unfit, train_cohort
from clients.cohort import _gradients as cohort_gradients
from clients.cohort import _log_softmax as cohort_log_softmax
from clients.trainer import LocalResult, TrainSettings, train_locally
from fl.common.config import compose
from fl.run.apps import CohortClientApp, CohortReplies
from fl.run.engines.local import LocalGrid
from fl.strategy.client import ClientHooks
from fl.strategy.registry import get_strategy
from fl.wire.records import Layout
from fl.world.task import get_task
from strategies.fedprox import FedProxHooks, FedProxParams


class _Scheduled(ClientHooks):
    """A cohort-safe client half whose lr and batch size change with the step."""

    cohort_safe = True

    def lr(self, step: int, base_lr: float) -> float:
        return base_lr / (1 + step)

    def batch_size(self, step: int, base: int) -> int:
        return base + 3 * (step % 3)


def _hooks(kind: type[ClientHooks]) -> ClientHooks:
    return kind(FedProxParams(mu=0.5)) if kind is FedProxHooks else kind(None)


def _members(
    clients: int, settings: TrainSettings, kind: type[ClientHooks], *overrides: str
) -> tuple[nn.Module, Layout, list[Member]]:
    """Digits clients of unequal sizes (Dirichlet), each from its own starting weights,
    their hooks begun on them (FedProx's anchor is the client's own start)."""
    task = get_task(compose(["partition=dirichlet", f"num_clients={clients}", *overrides]))
    model = task.new_model()
    layout = Layout.of(model.state_dict())
    first = layout.read(model)
    members = []
    for k in range(clients):
        start = first + 0.01 * k
        layout.load_into(model, start)
        hooks = _hooks(kind)
        hooks.begin(model, ConfigRecord(), RecordDict())
        x, y = task.client_data(k)
        members.append(Member(start, x, y, hooks, replace(settings, seed=1000 + k)))
    return model, layout, members


def _train_each(
    model: nn.Module, layout: Layout, members: list[Member], kind: type[ClientHooks]
) -> list[tuple[torch.Tensor, LocalResult]]:
    """Every member trained alone by `train_locally`, with fresh hooks of the same kind."""
    out = []
    for member in members:
        layout.load_into(model, member.start)
        hooks = _hooks(kind)
        hooks.begin(model, ConfigRecord(), RecordDict())
        result = train_locally(model, member.x, member.y, hooks, member.settings)
        out.append((layout.read(model), result))
    return out


def _excess(cohort: torch.Tensor, alone: torch.Tensor, steps: int) -> float:
    """The largest |diff| as a fraction of `steps` × the per-step bound (≤ 1 passes)."""
    bound = STEP_TOLERANCE["atol"] + STEP_TOLERANCE["rtol"] * alone.abs()
    return float(((cohort - alone).abs() / (steps * bound)).max())


def _compare(
    members: list[Member], trained: torch.Tensor, results: list[LocalResult], alone: list[Any]
) -> None:
    for member, row, result, (weights, expected) in zip(
        members, trained, results, alone, strict=True
    ):
        assert (result.steps, result.samples) == (expected.steps, expected.samples)
        assert member.hooks.time.samples == expected.samples  # what the clock charges
        assert result.mean_loss == pytest.approx(expected.mean_loss, rel=1e-5)
        assert _excess(row, weights, result.steps) <= 1.0
        assert float((row - member.start).abs().max()) > 1e-3  # it did train


@pytest.mark.parametrize(
    "kind, momentum, decay",
    [
        (ClientHooks, 0.0, 0.0),
        (ClientHooks, 0.9, 1e-3),
        (FedProxHooks, 0.5, 0.0),
        (_Scheduled, 0.0, 0.0),
    ],
)
def test_each_step_stays_within_the_tolerance_of_the_per_client_trainer(kind, momentum, decay):
    """After local step t (local_steps=t), each client's weights agree with the per-client
    trainer's within t × STEP_TOLERANCE, with the same steps, samples and loss."""
    for t in (1, 2, 3, 5, 8):
        settings = TrainSettings(t, 0, 16, 0.3, momentum, decay)
        model, layout, members = _members(6, settings, kind)
        trained, results = train_cohort(model, layout, members, torch.device("cpu"))
        _compare(members, trained, results, _train_each(model, layout, members, kind))
        assert all(r.steps == t for r in results)


def test_ragged_epochs_keep_each_clients_steps_samples_and_loss():
    """Two epochs over clients of unequal sizes: each client takes its own number of steps,
    its last batch short; inside the cohort they are ordered by steps, outside they are not."""
    model, layout, members = _members(8, TrainSettings(0, 2, 16, 0.3), ClientHooks)
    trained, results = train_cohort(model, layout, members, torch.device("cpu"))
    _compare(members, trained, results, _train_each(model, layout, members, ClientHooks))
    steps = [r.steps for r in results]
    assert len(set(steps)) > 2 and steps != sorted(steps, reverse=True)
    assert [r.samples for r in results] == [2 * len(m.y) for m in members]


def test_a_cnn_takes_the_vmap_path_within_the_same_tolerance():
    """Conv and pooling layers are not grouped matmuls (the MLP's path, which every other
    test here takes): the cohort runs torch.func.vmap over functional_call and autograd,
    and still keeps to the per-step tolerance (momentum included)."""
    from clients.cohort import _gradients, _grouped_mlp, _vmap_autograd

    model, layout, members = _members(
        4, TrainSettings(0, 1, 16, 0.1, 0.9), ClientHooks, "task.model=cnn"
    )
    assert _gradients(model).func is _vmap_autograd  # type: ignore[attr-defined]
    assert (
        _gradients(_members(2, TrainSettings(1, 0, 16, 0.1), ClientHooks)[0]).func is _grouped_mlp
    )  # type: ignore[attr-defined]
    trained, results = train_cohort(model, layout, members, torch.device("cpu"))
    _compare(members, trained, results, _train_each(model, layout, members, ClientHooks))


def test_lenet5_at_32px_runs_its_conv_trunk_per_client_within_the_same_tolerance():
    """Client batches of TRUNK_MIN_PIXELS or more on the CPU (LeNet-5 on 32×32 shapes, the
    room presets' workload): the conv trunk runs client by client and the head as grouped
    matmuls, within the per-step tolerance (momentum and weight decay included); smaller
    batches of the same model keep the vmap path."""
    from clients.cohort import TRUNK_MIN_PIXELS, _gradients, _trunk_autograd, _trunk_pays

    shapes = ["task=shapes", "task.model=lenet5", "task.options.size=32"]
    shapes += ["task.options.train_size=240", "task.options.test_size=20"]
    model, layout, members = _members(
        4, TrainSettings(3, 0, 8, 0.05, 0.9, 1e-3), ClientHooks, *shapes
    )
    x = members[0].x
    assert TRUNK_MIN_PIXELS == 4 * 32 * 32 and _trunk_pays(x, 4) and not _trunk_pays(x, 3)
    assert _gradients(model, True).func is _trunk_autograd  # type: ignore[attr-defined]
    trained, results = train_cohort(model, layout, members, torch.device("cpu"))
    _compare(members, trained, results, _train_each(model, layout, members, ClientHooks))
    # the check is sharp here too: another client's weights are far outside the bound
    alone = _train_each(model, layout, members, ClientHooks)
    assert _excess(trained[0], alone[1][0], 3) > 10


def test_another_seed_gives_other_batches_so_the_check_can_fail():
    """The comparison is sharp: one client's seed changed puts it far outside the bound."""
    model, layout, members = _members(3, TrainSettings(4, 0, 16, 0.3), ClientHooks)
    trained, _ = train_cohort(model, layout, members, torch.device("cpu"))
    members[1].settings = replace(members[1].settings, seed=7)
    weights, _ = _train_each(model, layout, members, ClientHooks)[1]
    assert _excess(trained[1], weights, 4) > 10


def test_the_mlps_written_out_backward_is_autograds():
    """The grouped MLP's hand-written backward (class-major log_softmax, ReLU's own
    backward kernel) gives each client the gradient and loss autograd gives it alone."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    k, batch = 4, 7
    stacked = {n: p.detach() + 0.1 * torch.randn(k, *p.shape) for n, p in model.named_parameters()}
    x, y = torch.randn(k, batch, 6), torch.randint(0, 5, (k, batch))
    sizes = torch.tensor([7, 3, 1, 5])
    mask = (torch.arange(batch) < sizes[:, None]).float()
    grads, losses = cohort_gradients(model)(stacked, x, y, mask, sizes)
    for c in range(k):
        params = {n: w[c].clone().requires_grad_() for n, w in stacked.items()}
        used = int(sizes[c])
        logits = torch.func.functional_call(model, params, (x[c, :used],))
        loss = nn.functional.cross_entropy(logits, y[c, :used])
        loss.backward()
        assert losses[c].item() == pytest.approx(loss.item(), rel=1e-6)
        for n, p in params.items():
            torch.testing.assert_close(grads[n][c], p.grad, rtol=1e-5, atol=1e-7)
    logits = torch.randn(50, 16, 10)
    torch.testing.assert_close(
        cohort_log_softmax(logits), torch.log_softmax(logits, dim=-1), rtol=0, atol=1e-6
    )


def test_cohort_safe_is_declared_by_each_class_not_inherited():
    class Plain(ClientHooks):
        pass

    assert ClientHooks.cohort_safe and FedProxHooks.cohort_safe and _Scheduled.cohort_safe
    assert not Plain.cohort_safe
    safe = {name: get_strategy(name).client.cohort_safe for name in (*STRATEGIES, *UNSAFE)}
    assert [name for name, ok in safe.items() if ok] == list(STRATEGIES)
    with pytest.raises(TypeError, match="overrides after_step"):

        class Stopping(ClientHooks):
            cohort_safe = True

            def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
                return False


def test_models_with_buffers_or_dropout_are_refused():
    assert cohort_unfit(nn.Sequential(nn.Linear(2, 2))) is None
    assert "buffers" in str(cohort_unfit(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))))
    assert "dropout" in str(cohort_unfit(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))))


# ----- the local engine's part ---------------------------------------------------------------
def _reply(msg: Message, path: str) -> Message:
    return Message(RecordDict({"out": ConfigRecord({"path": path})}), reply_to=msg)


def _toy_app() -> CohortClientApp:
    """Per message: a reply saying so. As a cohort: replies to every other message, fails
    the third, leaves the rest to the per-message path and keeps a mark in each state."""
    app = CohortClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return _reply(msg, "alone")

    @app.query("info")
    def info(msg: Message, context: Context) -> Message:
        return _reply(msg, "query")

    @app.cohort()
    def cohort(pairs: Sequence[tuple[Message, Context]]) -> CohortReplies:
        replies: list[Message | BaseException | None] = []
        for i, (msg, context) in enumerate(pairs):
            context.state["mark"] = ConfigRecord({"cohort": i})
            replies.append(_reply(msg, "cohort") if i % 2 == 0 else None)
        replies[2] = RuntimeError("this client fails alone")
        return CohortReplies(replies, "cohort: toy")

    return app


@pytest.mark.parametrize("serialize", [False, True])
def test_the_grid_keeps_the_pulls_order_and_each_messages_path(serialize):
    grid = LocalGrid(_toy_app(), 7, {}, cohort=True, serialize=serialize)
    nodes = list(grid.get_node_ids())
    kinds = ["train", "train", "query.info", "train", "train", "train", "train"]
    messages = [
        Message(RecordDict(), node, kind, group_id="1")
        for node, kind in zip(nodes, kinds, strict=True)
    ]
    replies = list(grid.send_and_receive(messages))
    assert [r.metadata.reply_to_message_id for r in replies] == [
        m.metadata.message_id for m in messages
    ]
    paths = [r.content["out"]["path"] if not r.has_error() else "error" for r in replies]
    # train messages 0..5 of the pull are cohort members 0..5: even ones replied, 2 failed
    assert paths == ["cohort", "alone", "query", "error", "alone", "cohort", "alone"]
    assert "this client fails alone" in replies[3].error.reason
    assert grid.cohort_trained == 3 and grid.cohort_path == "cohort: toy"
    marked = {n: s["mark"]["cohort"] for n, s in grid.states.items()}
    assert marked == {nodes[0]: 0, nodes[3]: 2, nodes[5]: 4}  # states of the messages it took
    grid.close()


def test_without_engine_cohort_the_grid_never_calls_the_cohort():
    grid = LocalGrid(_toy_app(), 3, {})
    messages = [Message(RecordDict(), n, "train", group_id="1") for n in grid.get_node_ids()]
    replies = list(grid.send_and_receive(messages))
    assert [r.content["out"]["path"] for r in replies] == ["alone"] * 3
    assert grid.cohort_trained == 0


def test_engine_cohort_is_checked_before_the_run():
    from fl.common.config import ConfigError
    from fl.run.validation import validate

    with pytest.raises(ConfigError, match=r"engine\.cohort='yes'"):
        validate(compose(["engine.cohort=yes"]))
    validate(compose(["engine.cohort=auto"]))


# ----- whole runs: engine.cohort=auto against the per-client path --------------------------
# strategy -> the overrides its short run needs; every cohort-safe client half is here
STRATEGY_RUNS: dict[str, tuple[str, ...]] = {
    "fedavg": (),
    "fedprox": ("strategy.mu=0.1",),
    "fedbuff": ("loop=semi_async",),
    "asfl": ("loop=semi_async", "system=heterogeneous"),
    "gift": ("local_steps=16",),
    "r2sp": ("loop=groups", "loop.groups=4", "local_steps=8"),
    "fl_r2sp": ("loop=groups", "local_steps=8"),
    "lrd2d": (),
    "fedsu": (),
    "flower": ("strategy.flower_class=FedProx", "+strategy.kwargs.proximal_mu=0.1"),
}
STRATEGIES = tuple(STRATEGY_RUNS)
UNSAFE = ("apf", "pas", "fedca", "fedca_plus", "graft")
EXACT = ("round", "virtual_time_s", "bytes_up", "bytes_down", "replies")


def _runs(
    tmp_path: Path, *overrides: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], LocalGrid]:
    """The same run client by client and as cohorts: both runs' rows, the cohort's grid."""
    common = ("rounds=3", "progress=false", "plots=false", *overrides)
    alone, _ = train_in_process(tmp_path / "alone", *common)
    cohort_grid = functools.partial(LocalGrid, cohort=True)
    together, grid = train_in_process(tmp_path / "cohort", *common, grid_class=cohort_grid)
    return alone, together, grid


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_cohort_safe_strategy_ends_with_the_per_client_metrics(tmp_path, strategy):
    alone, together, grid = _runs(tmp_path, f"strategy={strategy}", *STRATEGY_RUNS[strategy])
    assert grid.cohort_trained >= 2 * len(alone)  # the rounds really trained as cohorts
    assert grid.cohort_path.startswith("cohort: ")
    assert len(alone) == len(together) == 3
    for a, b in zip(alone, together, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if key in EXACT:  # counts: each client is charged its own samples
                assert b[key] == value, key
            elif isinstance(value, float) and key != "wall_time_s":
                assert b[key] == pytest.approx(value, **METRIC_TOLERANCE), key


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (("strategy=apf",), "strategy apf: its client half (APFHooks) is not cohort-safe"),
        (("strategy=pas", "local_steps=8"), "strategy pas: its client half (PASHooks)"),
        (("privacy=dpsgd",), "privacy=dpsgd clips per sample"),
        (("faults.dropout=0.2",), "faults or attacks"),
    ],
)
def test_what_is_not_cohort_safe_falls_back_and_says_so(tmp_path, overrides, reason):
    alone, together, grid = _runs(tmp_path, *overrides)
    assert grid.cohort_trained == 0
    assert grid.cohort_path.startswith("per client: ") and reason in grid.cohort_path
    strip = [{k: v for k, v in r.items() if k != "wall_time_s"} for r in alone]
    assert strip == [{k: v for k, v in r.items() if k != "wall_time_s"} for r in together]


def test_a_failing_cohort_stops_the_run_instead_of_failing_every_client(tmp_path, monkeypatch):
    import clients.app

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug in the cohort trainer")

    monkeypatch.setattr(clients.app, "train_cohort_of", broken)
    with pytest.raises(RuntimeError, match="a bug in the cohort trainer"):
        train_in_process(
            tmp_path,
            "rounds=1",
            "progress=false",
            grid_class=functools.partial(LocalGrid, cohort=True),
        )
