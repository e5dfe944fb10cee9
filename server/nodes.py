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
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import cast

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.superlink.grid import InMemoryGrid
from omegaconf import DictConfig

__all__ = [
    "NODE_WAIT_S",
    "FederationError",
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


def wait_for_nodes(grid: Grid, expected: int, wait_s: float) -> list[int]:
    """The connected node ids, once at least `expected` are; FederationError if never."""
    simulated = isinstance(grid, InMemoryGrid)
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


def discover_partitions(grid: Grid, expected: int, timeout_s: float = QUERY_S) -> dict[int, int]:
    """Map node id -> partition id for partitions `0 … expected-1`, asking every node.

    Call after `wait_for_nodes`. Nodes holding a partition outside that range are left
    out (with a warning); a partition held by two nodes, or by none, is a FederationError.
    """
    nodes = sorted(grid.get_node_ids())
    queries = [Message(RecordDict(), node, MessageType.QUERY + ".info") for node in nodes]
    replies = list(grid.send_and_receive(queries, timeout=timeout_s))
    held = {
        r.metadata.src_node_id: cast(int, r.content.config_records["info"]["partition-id"])
        for r in replies
        if r.has_content()
    }
    extra = {node: p for node, p in held.items() if not 0 <= p < expected}
    if extra:
        log.warning(
            "left out %d node(s) holding partitions outside 0…%d (num_clients=%d): %s",
            len(extra),
            expected - 1,
            expected,
            sorted(extra.values()),
        )
    found = {node: p for node, p in held.items() if node not in extra}
    twice = sorted(p for p, n in Counter(found.values()).items() if n > 1)
    missing = sorted(set(range(expected)) - set(found.values()))
    if twice or missing:
        raise FederationError(
            f"{len(held)} of {len(nodes)} nodes answered the partition query; partitions "
            f"held by several nodes: {twice}, by none: {missing}. Each SuperNode needs its "
            f"own --node-config 'partition-id=I num-partitions={expected}', "
            f"I = 0…{expected - 1}"
        )
    return found
