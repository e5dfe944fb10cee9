"""The Flower ClientApp: local training with the run's strategy hooks, and evaluation.

Runs unchanged on every engine; the strategy is looked up by name in the registry,
and per-client memory lives in the node's `Context.state`.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.trainer import TrainSettings, train_locally
from fl.codec import decode
from fl.config import from_run_config
from fl.registry import get_strategy
from fl.task import get_task

__all__ = ["app"]

app = ClientApp()


def _partition(context: Context) -> int:
    return int(context.node_config["partition-id"])


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Tell the server which data partition this node holds."""
    return Message(
        RecordDict({"info": ConfigRecord({"partition-id": _partition(context)})}), reply_to=msg
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training; the strategy's hooks shape it and encode the reply."""
    cfg = from_run_config(context.run_config)
    task = get_task(cfg)
    partition = _partition(context)
    strategy = dict(cfg.strategy)
    spec = get_strategy(str(strategy["name"]))
    hooks = spec.client(spec.make_params(strategy))
    model, layout = task.model(), task.layout
    config = msg.content.config_records["config"]
    hooks.load(model, msg.content, context.state, layout)
    hooks.begin(model, config, context.state)
    x, y = task.client_data(partition)
    server_round = cast(int, config["server-round"])
    settings = TrainSettings(
        local_steps=int(config.get("local-steps", cfg.local_steps)),
        local_epochs=cfg.local_epochs,
        batch_size=int(config.get("batch-size", cfg.batch_size)),
        lr=float(config.get("lr", cfg.lr)),
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        seed=int(np.random.SeedSequence([cfg.seed, server_round, partition]).generate_state(1)[0]),
    )
    result = train_locally(model, x, y, hooks, settings)
    records, extra = hooks.end(model, context.state, layout)
    metrics = MetricRecord(
        {
            "num-examples": len(y),
            "train-loss": result.mean_loss,
            "steps": result.steps,
            "samples": result.samples,
            "partition-id": partition,
            **extra,
        }
    )
    return Message(RecordDict({**records, "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy and loss of the received model on this client's training data."""
    cfg = from_run_config(context.run_config)
    task = get_task(cfg)
    model, layout = task.model(), task.layout
    model.load_state_dict(layout.unflatten(decode(msg.content, layout)))
    x, y = task.client_data(_partition(context))
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(F.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    metrics = MetricRecord({"num-examples": len(y), "loss": loss, "accuracy": accuracy})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
