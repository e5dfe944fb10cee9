"""The in-process Grid: persistent node state, crash isolation, Flower serialisation."""

from __future__ import annotations

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from fl.run.engines.local import LocalGrid


def _counting_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        counter = context.state.config_records.get("counter", ConfigRecord({"n": 0}))
        counter["n"] = int(counter["n"]) + 1
        context.state["counter"] = counter
        arrays = msg.content.array_records["arrays"]
        doubled = {k: v * 2 for k, v in arrays.to_torch_state_dict().items()}
        metrics = MetricRecord({"seen": int(counter["n"]), "num-examples": 1})
        return Message(
            RecordDict({"arrays": ArrayRecord(doubled), "metrics": metrics}), reply_to=msg
        )

    return app


def _send(grid: LocalGrid, nodes: list[int]) -> list[Message]:
    arrays = ArrayRecord({"w": torch.ones(3)})
    msgs = [Message(RecordDict({"arrays": arrays}), n, MessageType.TRAIN) for n in nodes]
    return list(grid.send_and_receive(msgs))


def test_node_state_persists_across_rounds():
    grid = LocalGrid(_counting_app(), 3, {})
    nodes = sorted(grid.get_node_ids())
    _send(grid, nodes)
    _send(grid, nodes[:1])
    replies = _send(grid, nodes)
    seen = {r.metadata.src_node_id: r.content.metric_records["metrics"]["seen"] for r in replies}
    assert seen == {nodes[0]: 3, nodes[1]: 2, nodes[2]: 2}
    # the state is what a checkpoint saves and restores
    saved = grid.state_dict()
    fresh = LocalGrid(_counting_app(), 3, {})
    fresh.load_state_dict(saved)
    assert fresh.context(nodes[0]).state.config_records["counter"]["n"] == 3


def test_node_ids_are_stable_and_partitions_cover_all_nodes():
    a, b = LocalGrid(_counting_app(), 5, {}, seed=1), LocalGrid(_counting_app(), 5, {}, seed=1)
    assert list(a.get_node_ids()) == list(b.get_node_ids())
    parts = sorted(int(a.context(n).node_config["partition-id"]) for n in a.get_node_ids())
    assert parts == [0, 1, 2, 3, 4]


def test_serialized_round_trip_gives_same_replies_and_reply_ids():
    plain = LocalGrid(_counting_app(), 2, {})
    wired = LocalGrid(_counting_app(), 2, {}, serialize=True)
    for grid in (plain, wired):
        replies = _send(grid, sorted(grid.get_node_ids()))
        for reply in replies:
            doubled = reply.content.array_records["arrays"].to_torch_state_dict()["w"]
            assert torch.equal(doubled, torch.full((3,), 2.0))
            assert reply.metadata.reply_to_message_id != ""


def test_crashing_client_becomes_an_error_reply():
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise ValueError("disk full")

    grid = LocalGrid(app, 2, {}, workers=2)
    replies = _send(grid, sorted(grid.get_node_ids()))
    assert len(replies) == 2
    assert all(r.has_error() and "ValueError: disk full" in r.error.reason for r in replies)
