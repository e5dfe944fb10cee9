"""Which SuperNodes take part in a run, and which data partition each one holds.

A run needs one node per partition, `0 … num_clients-1`. Too few nodes is an error, never
an adaptation: the data split, the clients' speed profiles and `clients_per_round` all
follow `num_clients`, so training on whatever connected would silently be another
experiment. How long to wait for missing nodes depends on who starts them:

- Flower's simulation (`flwr run` on a local simulation SuperLink, `engine=flower-sim`)
  registers all its nodes at once, so once their number stops changing it is final and a
  shortfall fails within seconds, naming the federation setting to change;
- in a deployment SuperNodes connect whenever they are started, so the ServerApp waits up
  to `engine.node_wait_s` for the rest, then fails.

Who may take part is fixed at run start: with `engine.allowed_nodes` (node ids and key
fingerprints) the ServerApp sees the grid through `AllowedGrid`, so a node off the list is
never counted, asked for its partition or sent any message; it is refused and logged. Of
the nodes it does see, one holding a partition outside `0 … num_clients-1`, or one already
held by a node with a lower id, is refused and logged too; only partitions that no
remaining node holds fail the run.

An in-process engine that assigned the partitions itself (the local engine) hands the
map over (`partition_map`, a `fl.world.population.PartitionMap`) instead of being asked node
by node.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Mapping
from typing import cast

from flwr.app import Message, MessageType, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=E0611
from flwr.serverapp import Grid
from omegaconf import DictConfig, ListConfig, OmegaConf

from fl.net.tls import fingerprint, is_allowlist
from fl.wire.grids import DelegatingGrid
from fl.world.population import PartitionMap

__all__ = [
    "NODE_WAIT_S",
    "AllowedGrid",
    "FederationError",
    "allowed_nodes",
    "discover_partitions",
    "node_wait_s",
    "wait_for_nodes",
]

log = logging.getLogger(__name__)

NODE_WAIT_S = 120.0  # without engine.node_wait_s (a ServerApp started by plain `flwr run`)
SETTLE_S = 2.0  # a simulation's node count unchanged this long is final
POLL_S = 0.5
QUERY_S = 120.0  # for every connected node's answer to the partition query


class FederationError(RuntimeError):
    """The connected nodes cannot serve this run's partitions."""


def node_wait_s(cfg: DictConfig) -> float:
    """How long a deployment's ServerApp waits for missing SuperNodes."""
    wait = cfg.engine.get("node_wait_s", NODE_WAIT_S)
    if not isinstance(wait, int | float) or isinstance(wait, bool) or wait < 0:
        raise ValueError(f"engine.node_wait_s={wait!r} must be a number of seconds >= 0")
    return float(wait)


def allowed_nodes(cfg: DictConfig) -> frozenset[int | str] | None:
    """`engine.allowed_nodes` (node ids and `SHA256:` key fingerprints), or None: no list."""
    entries = cfg.engine.get("allowed_nodes")
    if entries is None:
        return None
    listed = OmegaConf.to_container(entries) if isinstance(entries, ListConfig) else entries
    if not is_allowlist(listed):
        raise ValueError(
            f"engine.allowed_nodes={entries!r} must be a non-empty list of node ids and "
            f"SHA256:… key fingerprints"
        )
    return frozenset(cast(list[int | str], listed))


def _key(node: NodeInfo) -> str | None:
    """The fingerprint of the key a node authenticated with (None without node auth)."""
    return fingerprint(node.public_key) if node.public_key else None


class AllowedGrid(DelegatingGrid):
    """`grid` as seen by a ServerApp that trains only the nodes on an allow-list.

    Nodes off the list are left out of `get_node_ids`/`get_nodes` (each refusal logged
    once) and a message addressed to one is an error, so the round loop can neither count
    them, nor ask them for a partition, nor send them work. A node is on the list by its id
    (stable for a registered key) or by the fingerprint of the key it authenticated with.
    """

    def __init__(self, grid: Grid, allowed: frozenset[int | str]) -> None:
        super().__init__(grid)
        self.allowed = allowed
        self.refused: set[int] = set()
        self._admitted: set[int] = set()

    def _allows(self, node: NodeInfo) -> bool:
        return node.node_id in self.allowed or _key(node) in self.allowed

    def get_nodes(self) -> Iterable[NodeInfo]:
        admitted = []
        for node in self.inner.get_nodes():
            if self._allows(node):
                admitted.append(node)
                self._admitted.add(node.node_id)
            elif node.node_id not in self.refused:
                self.refused.add(node.node_id)
                log.warning(
                    "refused node %d (key %s): not on engine.allowed_nodes",
                    node.node_id,
                    _key(node) or "none: node authentication is off",
                )
        return admitted

    def get_node_ids(self) -> Iterable[int]:
        return [node.node_id for node in self.get_nodes()]

    def _check(self, messages: Iterable[Message]) -> list[Message]:
        out = list(messages)
        stray = sorted({m.metadata.dst_node_id for m in out} - self._admitted)
        if stray:
            raise FederationError(f"messages addressed to nodes not on the allow-list: {stray}")
        return out

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(self._check(messages))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.inner.send_and_receive(self._check(messages), timeout=timeout)


def _simulation_too_small(connected: int, expected: int) -> FederationError:
    return FederationError(
        f"Flower's simulation federation has {connected} SuperNodes but num_clients="
        f"{expected}: set num_clients={connected} (and clients_per_round<={connected}), or "
        f"resize the federation: `flwr run . <connection> --federation-config "
        f"num-supernodes={expected}`"
    )


def _deployment_too_small(connected: int, expected: int, wait_s: float) -> FederationError:
    return FederationError(
        f"only {connected} of {expected} nodes connected after {wait_s:g} s; start "
        f"{expected} SuperNodes (--node-config 'partition-id=0…{expected - 1} "
        f"num-partitions={expected}') or set num_clients={connected} "
        f"(engine.node_wait_s sets how long to wait)"
    )


def _simulated(grid: Grid) -> bool:
    """Whether `grid` is Flower's simulation grid (all nodes registered at once).

    Looked up where it is loaded: importing it costs seconds (its SQL state layer), and
    no grid can be one unless some engine already imported it.
    """
    module = sys.modules.get("flwr.superlink.grid.inmemory_grid")
    return module is not None and isinstance(grid, module.InMemoryGrid)


def wait_for_nodes(grid: Grid, expected: int, wait_s: float) -> list[int]:
    """The connected node ids, once at least `expected` are; FederationError if never."""
    simulated = _simulated(grid.inner if isinstance(grid, AllowedGrid) else grid)
    deadline = time.monotonic() + wait_s
    seen, stable_since = -1, time.monotonic()
    while len(nodes := sorted(grid.get_node_ids())) < expected:
        now = time.monotonic()
        if len(nodes) != seen:
            seen, stable_since = len(nodes), now
            log.info("waiting for nodes: %d of %d connected", len(nodes), expected)
        if simulated and nodes and now - stable_since >= SETTLE_S:
            raise _simulation_too_small(len(nodes), expected)
        if now >= deadline:
            raise _deployment_too_small(len(nodes), expected, wait_s)
        time.sleep(POLL_S)
    return nodes


def _claimed(reply: Message) -> int | None:
    """The partition id a node's `query.info` reply claims; None if it is not an int."""
    info = reply.content.config_records.get("info")
    partition = info.get("partition-id") if info is not None else None
    return partition if isinstance(partition, int) and not isinstance(partition, bool) else None


def discover_partitions(grid: Grid, expected: int, timeout_s: float = QUERY_S) -> Mapping[int, int]:
    """Map node id -> partition id for partitions `0 … expected-1`, asking every node.

    Call after `wait_for_nodes`. A node holding a partition outside that range, or one a
    node with a lower id already holds, is refused (logged) and never trained; a
    partition that no node holds is a FederationError. A grid that assigned the
    partitions itself in this process, to nodes that announce them as assigned
    (`partition_map()`), is not asked.
    """
    known = getattr(grid, "partition_map", None)
    mapping: PartitionMap | None = known() if callable(known) else None
    if mapping is not None:
        if len(mapping) != expected:
            raise FederationError(f"the engine runs {len(mapping)} nodes, not {expected}")
        return mapping
    nodes = sorted(grid.get_node_ids())
    queries = [Message(RecordDict(), node, MessageType.QUERY + ".info") for node in nodes]
    replies = list(grid.send_and_receive(queries, timeout=timeout_s))
    held = {r.metadata.src_node_id: _claimed(r) for r in replies if r.has_content()}
    found: dict[int, int] = {}
    holder: dict[int, int] = {}  # partition -> node
    twice: set[int] = set()
    for node, partition in sorted(held.items()):
        if partition is None:
            log.warning("refused node %d: its reply to the partition query is malformed", node)
        elif not 0 <= partition < expected:
            log.warning(
                "refused node %d: it holds partition %d, outside 0…%d (num_clients=%d)",
                node,
                partition,
                expected - 1,
                expected,
            )
        elif partition in holder:
            twice.add(partition)
            log.warning(
                "refused node %d: partition %d is already held by node %d",
                node,
                partition,
                holder[partition],
            )
        else:
            holder[partition] = node
            found[node] = partition
    missing = sorted(set(range(expected)) - set(holder))
    if missing:
        raise FederationError(
            f"{len(held)} of {len(nodes)} nodes answered the partition query; partitions "
            f"held by several nodes: {sorted(twice)}, by none: {missing}. Each SuperNode "
            f"needs its own --node-config 'partition-id=I num-partitions={expected}', "
            f"I = 0…{expected - 1}"
        )
    return found
