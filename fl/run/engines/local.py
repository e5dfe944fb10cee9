"""The `local` engine: an in-process implementation of Flower's `Grid`.

One process, no Ray, no sockets: `push_messages` queues instructions, `pull_messages`
runs the ClientApp for them (in order, or on a thread pool) and returns the replies. With
`engine.cohort=auto` it first hands a pull's train messages to the app's cohort trainer
together (`fl.run.apps.CohortClientApp`): the app trains those it can as one batched
program and leaves the rest to the per-message path; the grid logs which path they took.
Each node has a persistent `Context`, as a SuperNode would, so client state survives
across rounds. A node's Context is built when a message reaches it and released after
its reply; only non-empty states are kept, compactly (`NodeStates`), and they are part
of the run's checkpoint. So memory and start-up follow the clients that train, not the
population: a million nodes cost their ids and partitions (24 bytes each) until sampled.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fl.run.apps import SERVER_APP, Apps, CohortClientApp
from fl.run.engines.carriers import takes_cohort_replies
from fl.run.engines.node_states import DEFAULT_MEMORY_BYTES, NodeStates
from fl.run.faults import NoReply
from fl.world.population import PartitionMap

__all__ = ["SERVER_NODE_ID", "LocalGrid", "run_local"]

SERVER_NODE_ID = 0
log = logging.getLogger(__name__)  # our lines under our name, not Flower's `[flwr]`
CLIENT_EXCEPTION = 3  # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def _wire_roundtrip(msg: Message) -> Message:
    """The message as the receiver would see it after Flower's protobuf serialisation."""
    proto = ProtoMessage.FromString(message_to_proto(msg).SerializeToString())
    return message_from_proto(proto)


class LocalGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process."""

    # pull_messages answers every instruction it holds, at once: one it did not answer
    # (an injected dropout or hang) never will be, so a wrapper need not wait for it
    synchronous = True

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
        spill_dir: Path | None = None,
        state_memory_bytes: int = DEFAULT_MEMORY_BYTES,
        announces_partitions: bool = False,
        cohort: bool = False,
        cohort_replies: bool = False,
    ) -> None:
        """`announces_partitions`: the ClientApp reports its node config's partition (ours
        does), so the server may take the map from `partition_map` instead of asking every
        node; `spill_dir` and `state_memory_bytes`: where node states go past that budget;
        `cohort`: hand a pull's train messages to the app's cohort trainer together, where
        the app has one (`fl.run.apps.CohortClientApp`, `engine.cohort=auto`);
        `cohort_replies`: let the cohort answer its plain members in one reply
        (`fl.wire.cohort_reply`), where the server's loop takes such replies."""
        self.client_app = client_app
        self.cohort = client_app.cohort_train if isinstance(client_app, CohortClientApp) else None
        if not cohort:
            self.cohort = None
        self.cohort_replies = cohort_replies
        self.cohort_trained = 0  # train messages answered by a cohort
        self.cohort_path = ""  # what the last pull's train messages took, in words
        self.announces_partitions = announces_partitions
        self.workers = workers
        self.serialize = serialize
        self._run = Run.create_empty(run_id)
        self._run.override_config = dict(run_config)
        self.run_config = dict(run_config)
        ids = np.random.default_rng([seed, 0x1D]).choice(2**62, size=num_nodes, replace=False)
        self.nodes = PartitionMap(ids + 1)  # partition p is held by node ids[p] + 1
        self.states = NodeStates(spill_dir, state_memory_bytes)
        self.built = 0  # Contexts built so far (one per message handled)
        self.live = 0  # Contexts alive now
        self.peak_live = 0
        self._count_lock = threading.Lock()
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
        return list(self.nodes)  # sorted

    def partition_map(self) -> PartitionMap | None:
        """node id -> partition as assigned here, when the ClientApp announces just that."""
        return self.nodes if self.announces_partitions else None

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self.nodes:
                raise ValueError(f"no node {msg.metadata.dst_node_id} in this grid")
            msg_id = str(next(self._ids))
            msg.metadata.__dict__["_message_id"] = msg_id
            self._pending[msg_id] = msg
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        batch = [self._pending.pop(i) for i in message_ids if i in self._pending]
        done: dict[int, Message | None] = {}
        if self.cohort is not None:
            done = self._train_cohort(batch)
        rest = [msg for i, msg in enumerate(batch) if i not in done]
        replies = iter(
            map(self._handle, rest) if self._pool is None else self._pool.map(self._handle, rest)
        )
        ordered = (done[i] if i in done else next(replies) for i in range(len(batch)))
        return [reply for reply in ordered if reply is not None]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    # ----- nodes ------------------------------------------------------------------------
    def context(self, node_id: int) -> Context:
        """A node's Context as a SuperNode holds it: its partition and its saved state."""
        return Context(
            run_id=self._run.run_id,
            node_id=node_id,
            node_config={"partition-id": self.nodes[node_id], "num-partitions": len(self.nodes)},
            state=self.states.get_state(node_id),
            run_config=dict(self.run_config),
        )

    def _handle(self, msg: Message) -> Message | None:
        """Run the ClientApp for one instruction, as a SuperNode would (None: no reply)."""
        node_id = msg.metadata.dst_node_id
        context = self.context(node_id)
        self._count(+1)
        try:
            return self._reply(msg, context)
        finally:
            self.states.put(node_id, context.state)
            self._count(-1)

    def _train_cohort(self, batch: list[Message]) -> dict[int, Message | None]:
        """The replies the cohort trainer gave, by position in `batch`: to the train
        messages of distinct nodes, as one call; the app leaves the rest to `_handle`.
        A cohort reply stands at its first member's position, None at the others'."""
        assert self.cohort is not None
        trains = [
            i for i, msg in enumerate(batch) if msg.metadata.message_type == MessageType.TRAIN
        ]
        if len(trains) < 2:
            return {}
        nodes = {i: batch[i].metadata.dst_node_id for i in trains}
        once = Counter(nodes.values())
        picked = [i for i in trains if once[nodes[i]] == 1]  # a node asked twice: in turn
        if len(picked) < 2:
            return {}
        messages = [batch[i] for i in picked]
        if self.serialize:
            messages = [_wire_roundtrip(msg) for msg in messages]
        contexts = [self.context(nodes[i]) for i in picked]
        self._count(len(picked))
        try:
            pairs = list(zip(messages, contexts, strict=True))
            # (asked for only where wanted: a cohort trainer may take just the pairs)
            outcome = self.cohort(pairs, True) if self.cohort_replies else self.cohort(pairs)
        finally:
            self._count(-len(picked))
        done: dict[int, Message | None] = {}
        if outcome.batch is not None and outcome.in_batch:
            first = outcome.in_batch[0]
            joint = Message(outcome.batch, reply_to=messages[first])
            done[picked[first]] = _wire_roundtrip(joint) if self.serialize else joint
            for k in outcome.in_batch:
                done.setdefault(picked[k], None)
                self.states.put(nodes[picked[k]], contexts[k].state)
        for i, msg, context, reply in zip(picked, messages, contexts, outcome.replies, strict=True):
            if reply is None:
                continue
            self.states.put(nodes[i], context.state)
            if isinstance(reply, BaseException):
                reason = f"{type(reply).__name__}: {reply}"
                reply = Message(Error(CLIENT_EXCEPTION, reason), reply_to=msg)
            done[i] = _wire_roundtrip(reply) if self.serialize else reply
        self.cohort_trained += len(done)
        if outcome.path != self.cohort_path:  # the run says which path it took, when it changes
            log.info("local engine: %d train messages, %s", len(picked), outcome.path)
            self.cohort_path = outcome.path
        return done

    def _reply(self, msg: Message, context: Context) -> Message | None:
        if self.serialize:
            msg = _wire_roundtrip(msg)
        try:
            reply = self.client_app(msg, context)
        except NoReply:  # an injected dropout or hang: nothing arrives this round
            return None
        except Exception as err:  # a crashing client must not stop the round
            reply = Message(Error(CLIENT_EXCEPTION, f"{type(err).__name__}: {err}"), reply_to=msg)
        return _wire_roundtrip(reply) if self.serialize else reply

    def _count(self, change: int) -> None:
        with self._count_lock:
            self.live += change
            self.built += max(change, 0)
            self.peak_live = max(self.peak_live, self.live)

    def state_dict(self) -> Mapping[int, RecordDict]:
        """The nodes' non-empty states, for the run's checkpoint (decoded one at a time)."""
        return self.states

    def load_state_dict(self, states: Mapping[int, RecordDict]) -> None:
        """Restore node states saved by `state_dict` (every other node's state is empty)."""
        unknown = [node for node in states if node not in self.nodes]
        if unknown:
            raise ValueError(f"saved states of nodes not in this grid: {unknown[:5]}")
        self.states.clear()
        for node_id, state in states.items():
            self.states.put(node_id, state)

    def close(self) -> None:
        """Release the worker threads and any spilled state file."""
        if self._pool is not None:
            self._pool.shutdown()
        self.states.close()


def _state_memory_bytes(cfg: Any) -> int:
    """`engine.state_memory_mb` in bytes (checked by `check_engine`; 0 keeps every state in
    SQLite)."""
    return int(cfg.engine.get("state_memory_mb", DEFAULT_MEMORY_BYTES / 2**20) * 2**20)


# From this many clients a round, a run on the per-client path says the cohort path exists.
COHORT_HINT_CLIENTS = 100


def run_local(cfg: Any, run_config: dict[str, Any], apps: Apps | None = None) -> None:
    """Run `apps.server` against a LocalGrid of `cfg.num_clients` `apps.client` nodes
    (default: the project's ServerApp and ClientApp, as before `apps` was added)."""
    from fl.run.console import flower_logs_once  # the server's side: tqdm, not on edge clients
    from fl.world.task import get_task  # (built by preflight: cached)

    apps = apps or Apps.load()
    flower_logs_once()  # a Flower strategy's lines (strategy=flower): once each, not twice
    _freeze_imports()
    if cfg.clients_per_round >= cfg.num_clients:  # round 1 needs every client's data
        get_task(cfg).build_clients()  # (after the freeze: a sweep's next job frees it)
    cohort = cfg.engine.get("cohort", "off") == "auto"
    if not cohort and cfg.clients_per_round >= COHORT_HINT_CLIENTS:
        log.info(
            "hint: engine.cohort=auto trains a round's clients as one batched program where "
            "the strategy is cohort-safe (several times faster; weights within documented "
            "float tolerances, not bit-identical to this path: docs/SCALE.md)",
        )
    grid = LocalGrid(
        apps.client,
        cfg.num_clients,
        run_config,
        seed=cfg.seed,
        workers=cfg.engine.workers,
        serialize=cfg.engine.serialize,
        spill_dir=Path(cfg.output_dir) if cfg.get("output_dir") else None,
        state_memory_bytes=_state_memory_bytes(cfg),
        announces_partitions=True,  # our ClientApp answers `query.info` with its node config
        cohort=cohort,
        cohort_replies=cohort and _takes_cohort_replies(cfg, apps),
    )
    context = Context(
        run_id=grid.run.run_id,
        node_id=SERVER_NODE_ID,
        node_config={},
        state=RecordDict(),
        run_config=dict(run_config),
    )
    try:
        apps.server(grid, context)
    finally:
        grid.close()


def _takes_cohort_replies(cfg: Any, apps: Apps) -> bool:
    """Whether the run's server takes a cohort's one reply: our ServerApp's round loop, in
    the runs `carriers.takes_cohort_replies` names."""
    return apps.server_ref == SERVER_APP and takes_cohort_replies(cfg)


@functools.cache
def _freeze_imports() -> None:
    """Keep full garbage collections off the ~230,000 objects of the imported modules
    (torch, Flower, Hydra): they would walk them every time, during rounds too.

    Once per process, never undone: a Hydra multirun calls `run_local` once per job, and
    a collection of the whole heap before each freeze cost ~0.15 s a job. What each job
    builds stays unfrozen and is collected as usual when the job ends. No collection
    before it either: it cost ~0.1 CPU s to reclaim ~0.8 MB of Hydra's composition
    garbage, which now stays frozen for the process's life.
    """
    gc.freeze()
