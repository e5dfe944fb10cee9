"""The `local` engine: an in-process implementation of Flower's `Grid`.

One process, no Ray, no sockets: `push_messages` queues instructions, `pull_messages`
runs the ClientApp for them (in order, or on a thread pool) and returns the replies.
Each node has a persistent `Context`, exactly as a SuperNode would, so client state
survives across rounds; the contexts are part of the run's checkpoint.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fl.faults import NoReply

__all__ = ["SERVER_NODE_ID", "LocalGrid", "run_local"]

SERVER_NODE_ID = 0
CLIENT_EXCEPTION = 3  # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def _wire_roundtrip(msg: Message) -> Message:
    """The message as the receiver would see it after Flower's protobuf serialisation."""
    proto = ProtoMessage.FromString(message_to_proto(msg).SerializeToString())
    return message_from_proto(proto)


class LocalGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process."""

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: dict[str, Any],
        *,
        seed: int = 0,
        workers: int = 1,
        serialize: bool = False,
        run_id: int = 1,
    ) -> None:
        self.client_app = client_app
        self.workers = workers
        self.serialize = serialize
        self._run = Run.create_empty(run_id)
        self._run.override_config = dict(run_config)
        ids = np.random.default_rng([seed, 0x1D]).choice(2**62, size=num_nodes, replace=False)
        self.contexts = {
            int(node_id): Context(
                run_id=run_id,
                node_id=int(node_id),
                node_config={"partition-id": p, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for p, node_id in enumerate(ids + 1)
        }
        self._pending: dict[str, Message] = {}
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(workers) if workers > 1 else None
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SERVER_NODE_ID
        TaskIdentity.task_id = 0

    # ----- Grid interface ---------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self.contexts:
                raise ValueError(f"no node {msg.metadata.dst_node_id} in this grid")
            msg_id = str(next(self._ids))
            msg.metadata.__dict__["_message_id"] = msg_id
            self._pending[msg_id] = msg
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        batch = [self._pending.pop(i) for i in message_ids if i in self._pending]
        replies = (
            map(self._handle, batch) if self._pool is None else self._pool.map(self._handle, batch)
        )
        return [reply for reply in replies if reply is not None]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    # ----- nodes ------------------------------------------------------------------------
    def _handle(self, msg: Message) -> Message | None:
        """Run the ClientApp for one instruction, as a SuperNode would (None: no reply)."""
        context = self.contexts[msg.metadata.dst_node_id]
        if self.serialize:
            msg = _wire_roundtrip(msg)
        try:
            reply = self.client_app(msg, context)
        except NoReply:  # an injected dropout or hang: nothing arrives this round
            return None
        except Exception as err:  # a crashing client must not stop the round
            reply = Message(Error(CLIENT_EXCEPTION, f"{type(err).__name__}: {err}"), reply_to=msg)
        return _wire_roundtrip(reply) if self.serialize else reply

    def state_dict(self) -> dict[int, RecordDict]:
        """Every node's persistent state, for the run's checkpoint."""
        return {node_id: ctx.state for node_id, ctx in self.contexts.items()}

    def load_state_dict(self, states: dict[int, RecordDict]) -> None:
        """Restore node states saved by `state_dict`."""
        for node_id, state in states.items():
            self.contexts[node_id].state = state


def run_local(cfg: Any, run_config: dict[str, Any]) -> None:
    """Run the ServerApp against a LocalGrid of `cfg.num_clients` ClientApp nodes."""
    from clients.app import app as client_app
    from server.app import app as server_app

    grid = LocalGrid(
        client_app,
        cfg.num_clients,
        run_config,
        seed=cfg.seed,
        workers=cfg.engine.workers,
        serialize=cfg.engine.serialize,
    )
    context = Context(
        run_id=grid.run.run_id,
        node_id=SERVER_NODE_ID,
        node_config={},
        state=RecordDict(),
        run_config=dict(run_config),
    )
    # Thousands of long-lived node contexts make every full garbage collection walk
    # them; freezing what exists now keeps collections to the per-round garbage.
    gc.collect()
    gc.freeze()
    try:
        server_app(grid, context)
    finally:
        gc.unfreeze()
