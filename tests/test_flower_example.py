"""examples/apf_app: APF's client half in a plain Flower ClientApp, via `train_with_hooks`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, fl_env
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from netns import in_netns, require_netns

from fl.run.engines.local import LocalGrid
from fl.wire.contract import CONTRACT_MISMATCH, stamp


def _rows(stdout: str) -> tuple[list[dict], dict]:
    """The example's per-round lines and its final diagnostics."""
    rows = [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines()
            if line.startswith("apf-example ")]  # fmt: skip
    final = [line for line in stdout.splitlines() if line.startswith("apf-example-final ")]
    return rows, json.loads(final[-1].split(" ", 1)[1])


def _check(rows: list[dict], final: dict) -> None:
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["accuracy"] < 0.2 and rows[-1]["accuracy"] > 0.6  # 10 classes
    assert all(r["num-examples"] == 1500 for r in rows[1:])  # 4 nodes share 1,500 digits
    # APF froze scalars, and every masked reply decoded and passed our checks
    assert final["frozen_fraction"] > 0
    assert final["rejected"] == final["failed"] == 0


def test_example_app_on_an_in_process_grid(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO))
    from examples.apf_app import app

    grid = LocalGrid(app.clientapp, app.NODES, {})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    app.serverapp(grid, context)
    _check(*_rows(capsys.readouterr().out))


def test_train_with_hooks_refuses_another_strategys_instruction(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from examples.apf_app import app

    grid = LocalGrid(app.clientapp, 1, {})
    config = ConfigRecord({"server-round": 1, **stamp("pas")})
    content = RecordDict({"arrays": ArrayRecord(app._model().state_dict()), "config": config})
    node = next(iter(grid.get_node_ids()))
    (reply,) = grid.send_and_receive([Message(content, node, MessageType.TRAIN)])
    assert reply.error.code == CONTRACT_MISMATCH
    assert "strategy=pas" in reply.error.reason and "strategy=apf" in reply.error.reason


@pytest.mark.slow  # Ray: 110 s on a busy 2-core machine
@pytest.mark.integration
def test_example_app_on_flowers_simulation():
    require_netns()  # Ray probes 8.8.8.8 on start: loopback only
    proc = subprocess.run(
        in_netns([sys.executable, "-m", "examples.apf_app.simulate"]),
        cwd=REPO,
        env=fl_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check(*_rows(proc.stdout))


def test_train_with_hooks_follows_the_servers_steps_and_lr():
    import torch
    from flwr.clientapp import ClientApp
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from clients.hooked import train_with_hooks

    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(10, 3), torch.tensor([0, 1] * 5))
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        loader = DataLoader(data, batch_size=4)  # batches of 4, 4, 2
        return train_with_hooks(msg, context, model, optimizer, loader, strategy="fedavg")

    grid = LocalGrid(app, 1, {})
    start = {k: v.clone() for k, v in model.state_dict().items()}
    config = ConfigRecord({"server-round": 1, "local-steps": 5, "lr": 0.0, **stamp("fedavg")})
    content = RecordDict({"arrays": ArrayRecord(start), "config": config})
    (reply,) = grid.send_and_receive([Message(content, next(iter(grid.get_node_ids())), "train")])
    metrics = reply.content.metric_records["metrics"]
    assert (metrics["steps"], metrics["samples"], metrics["num-examples"]) == (5, 18, 10)
    returned = reply.content.array_records["arrays"].to_torch_state_dict()
    assert all(torch.equal(returned[k], start[k]) for k in start)  # the server's lr 0
    assert optimizer.param_groups[0]["lr"] == 0.1  # the user's optimizer is given back
