"""APF in a plain Flower app: the client half around our own model, optimizer and loader.

The ServerApp runs APF's server half in Flower's own round loop (`Strategy.start`); the
ClientApp trains a model it builds itself with `clients.hooked.train_with_hooks`, which
applies APF's hooks (synced model and mask, roll-back of frozen scalars, masked reply).
Nothing here uses our Hydra config, engines or round loop.

    python -m examples.apf_app.simulate           # Flower's simulation (Ray), 4 nodes, 3 rounds
    python -m examples.apf_app.simulate --local   # the same apps on our in-process grid, no Ray
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clients.hooked import train_with_hooks
from fl.api import get_strategy

__all__ = ["clientapp", "serverapp"]

ROUNDS, NODES, HELD_OUT = 3, 4, 297  # the last 297 digits are the server's test set


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _digits(start: int, stop: int) -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x[start:stop] / 16.0, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(y[start:stop]))


def _partition(partition: int, partitions: int) -> DataLoader:
    """Contiguous shares of the first 1,500 digits, one per node."""
    bounds = np.linspace(0, 1797 - HELD_OUT, partitions + 1).astype(int)
    data = _digits(int(bounds[partition]), int(bounds[partition + 1]))
    return DataLoader(
        data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(partition)
    )


clientapp = ClientApp()


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    """One round of APF's client half on this node's share of digits."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    loader = _partition(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    params = {"threshold": 0.5}  # the client half's params mirror the server's
    return train_with_hooks(msg, context, model, optimizer, loader, strategy="apf", params=params)


serverapp = ServerApp()


def _accuracy(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    model = _model()
    model.load_state_dict(arrays.to_torch_state_dict())
    x, y = _digits(1797 - HELD_OUT, 1797).tensors
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return MetricRecord({"accuracy": accuracy})


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    """APF's server half in Flower's own loop; one JSON line per round on stdout."""
    while len(list(grid.get_node_ids())) < NODES:  # simulated nodes register after we start
        time.sleep(0.1)
    spec = get_strategy("apf")
    # a loose stability threshold, so that scalars freeze within this short demo
    params = spec.make_params({"threshold": 0.5})
    strategy = spec.server(params, seed=0, clients_per_round=NODES)
    strategy.fraction_evaluate = 0.0  # the server evaluates on held-out digits instead
    # APF's server half stamps every instruction with its name and contract version: a
    # ClientApp running another strategy refuses it, and a round of refusals stops this loop
    # with fl.api.ContractMismatch (one line) instead of training nothing
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_model().state_dict()),
        num_rounds=ROUNDS,
        evaluate_fn=_accuracy,
    )
    for server_round, metrics in sorted(result.evaluate_metrics_serverapp.items()):
        trained = result.train_metrics_clientapp.get(server_round, MetricRecord())
        row = {"round": server_round, **dict(metrics), **dict(trained)}
        print("apf-example " + json.dumps(row), flush=True)
    print("apf-example-final " + json.dumps(strategy.diagnostics()), flush=True)
