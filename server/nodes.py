"""Which SuperNodes take part in a run, and which data partition each one holds."""

from __future__ import annotations

import time
from typing import cast

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

__all__ = ["discover_partitions"]


def discover_partitions(grid: Grid, expected: int, timeout_s: float = 300.0) -> dict[int, int]:
    """Map node id -> partition id by asking every node (waits for `expected` nodes)."""
    deadline = time.monotonic() + timeout_s
    while len(nodes := sorted(grid.get_node_ids())) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(nodes)} of {expected} nodes connected after {timeout_s} s"
            )
        time.sleep(0.5)
    queries = [Message(RecordDict(), node, MessageType.QUERY + ".info") for node in nodes]
    replies = list(grid.send_and_receive(queries, timeout=timeout_s))
    found = {
        r.metadata.src_node_id: cast(int, r.content.config_records["info"]["partition-id"])
        for r in replies
        if r.has_content()
    }
    if len(found) < expected:
        raise RuntimeError(f"{len(found)} of {expected} nodes answered the partition query")
    return found
