"""The Flower ClientApp: local training with the run's strategy hooks, and evaluation.

Runs unchanged on every engine; the strategy is looked up by name in the registry,
and per-client memory lives in the node's `Context.state`. Its data partition is the
node config's `partition-id`; with a run config that carries none of ours (a stock Flower
ServerApp, as in Flower's templates) the run is our defaults split into the node config's
`num-partitions`. An instruction for another strategy, or another contract version, gets
an error reply naming both (`fl.wire.contract`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from omegaconf import DictConfig

from clients.trainer import LocalResult, TrainSettings, train_locally
from fl.common.config import RUN_CONFIG_KEY, from_run_config, plain, run_config_key
from fl.common.seeding import derive_seed, pin_torch_threads
from fl.net.transport import bulk_mod
from fl.run.faults import fault_mod
from fl.strategy.client import ClientHooks, ClientTime
from fl.strategy.registry import StrategySpec, get_strategy
from fl.wire.codec import decode, payload_traffic
from fl.wire.contract import echo, mismatch_reply
from fl.wire.records import new_record, required_record
from fl.world.task import Task, get_task
from privacy.dpsgd import DPSGD

__all__ = ["Round", "Trainer", "app", "train_in_process", "train_message"]

# bulk_mod: arrays beside Flower's messages when the server offers it (fl.net.transport);
# outermost, so that faults act on the arrays as the ClientApp made them.
app = ClientApp(mods=[bulk_mod, fault_mod])  # fault_mod: the configured faults (none by default)

# Train-config keys a strategy may set per node and round (GIFT's local steps, LB-BSP's
# batch size, 2D-LRD's learning rate); absent keys keep the run's values.
PER_ROUND_KEYS = {
    "local-steps": "local_steps",
    "local-epochs": "local_epochs",
    "batch-size": "batch_size",
    "lr": "lr",
}


@dataclass(frozen=True)
class _Setup:
    """What every train call of a run needs, resolved once per process."""

    seed: int
    task: Task
    spec: StrategySpec
    params: Any
    settings: TrainSettings
    dp: DPSGD | None  # DP-SGD settings when privacy=dpsgd
    num_clients: int


_SETUPS: dict[str, _Setup] = {}


def _make_setup(cfg: DictConfig) -> _Setup:
    pin_torch_threads(cfg.torch_threads)
    strategy = plain(cfg.strategy)
    spec = get_strategy(str(strategy["name"]))
    settings = TrainSettings(
        local_steps=cfg.local_steps,
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )
    params = spec.make_params(strategy)
    dp = DPSGD.from_config(cfg)
    return _Setup(cfg.seed, get_task(cfg), spec, params, settings, dp, int(cfg.num_clients))


def _node_int(context: Context, key: str, low: int) -> int:
    """An integer of the node config, or a ValueError saying how to set it."""
    value = context.node_config.get(key)
    try:
        number = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = -1
    if isinstance(value, bool) or number < low:
        raise ValueError(
            f"node config {key}={value!r}: this ClientApp needs integers partition-id >= 0 "
            "and num-partitions >= 1 (flower-supernode --node-config "
            "'partition-id=0 num-partitions=10'; Flower's simulation sets both)"
        )
    return number


def _run_config(context: Context) -> dict[str, Any]:
    """The run config, or our defaults split into the node config's `num-partitions`
    when it carries none of ours (a stock Flower ServerApp)."""
    if RUN_CONFIG_KEY in context.run_config or "overrides" in context.run_config:
        return dict(context.run_config)
    n = _node_int(context, "num-partitions", 1)
    return {"overrides": f"num_clients={n} clients_per_round={n}"}


def _setup_of(context: Context) -> _Setup:
    run_config = _run_config(context)
    key = run_config_key(run_config)
    if key not in _SETUPS:
        _SETUPS[key] = _make_setup(from_run_config(run_config))
    return _SETUPS[key]


def _partition(context: Context, clients: int) -> int:
    """The node's partition, within the run's `clients`."""
    partition = _node_int(context, "partition-id", 0)
    if partition >= clients:
        raise ValueError(f"node config partition-id={partition}: the run has {clients} clients")
    return partition


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Tell the server which data partition this node holds (it checks the range itself)."""
    record = ConfigRecord({"partition-id": _node_int(context, "partition-id", 0)})
    return Message(RecordDict({"info": record}), reply_to=msg)


@dataclass(frozen=True)
class Round:
    """One train instruction, prepared: the model loaded and the hooks begun, the settings
    for this node and round, its data. What a trainer (local, or a cluster's ranks) runs."""

    setup: _Setup
    config: ConfigRecord
    model: torch.nn.Module
    hooks: ClientHooks
    settings: TrainSettings
    partition: int
    data: tuple[torch.Tensor, torch.Tensor]


# A trainer runs a prepared round in place; its second value gives the reply's own metrics
# (called after the hooks have encoded the reply).
Trainer = Callable[[Round, Context], tuple[LocalResult, Callable[[], dict[str, Any]]]]


def train_message(msg: Message, context: Context, trainer: Trainer) -> Message:
    """One round of training by `trainer`; the strategy's hooks shape it and encode the reply."""
    setup = _setup_of(context)
    config = required_record(msg.content, "config", ConfigRecord)
    refusal = mismatch_reply(msg, config, setup.spec.name)
    if refusal is not None:
        return refusal
    partition = _partition(context, setup.num_clients)
    hooks = setup.spec.client(setup.params)
    model, layout = setup.task.model(), setup.task.layout
    hooks.time = ClientTime.from_config(config, payload_traffic(msg.content).total)
    hooks.load(model, msg.content, context.state, layout)
    hooks.begin(model, config, context.state)
    server_round = cast(int, config["server-round"])
    per_round: dict[str, Any] = {
        field: config[key] for key, field in PER_ROUND_KEYS.items() if key in config
    }
    seed = derive_seed(setup.seed, server_round, partition)
    settings = replace(setup.settings, seed=seed, **per_round)
    data = setup.task.client_data(partition)
    prepared = Round(setup, config, model, hooks, settings, partition, data)
    result, own_metrics = trainer(prepared, context)
    records, extra = hooks.end(model, context.state, layout)
    metrics = new_record(
        MetricRecord,
        {
            "num-examples": len(data[1]),
            "train-loss": result.mean_loss,
            "steps": result.steps,
            "samples": result.samples,
            "partition-id": partition,
            **extra,
            **own_metrics(),
            **echo(config),
        },
    )
    return Message(new_record(RecordDict, {**records, "metrics": metrics}), reply_to=msg)


def train_in_process(
    prepared: Round, context: Context
) -> tuple[LocalResult, Callable[[], dict[str, Any]]]:
    """Local SGD in this process, with DP-SGD when the run asks for it."""
    dp, (x, y) = prepared.setup.dp, prepared.data
    private = dp.session(len(y), prepared.config, prepared.settings.seed) if dp else None
    result = train_locally(prepared.model, x, y, prepared.hooks, prepared.settings, private)
    return result, lambda: private.account(context.state, result.steps) if private else {}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training; the strategy's hooks shape it and encode the reply."""
    return train_message(msg, context, train_in_process)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy and loss of the received model on this client's training data."""
    setup = _setup_of(context)
    task = setup.task
    model, layout = task.model(), task.layout
    layout.load_into(model, decode(msg.content, layout))
    x, y = task.client_data(_partition(context, setup.num_clients))
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(F.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    metrics = MetricRecord({"num-examples": len(y), "loss": loss, "accuracy": accuracy})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
