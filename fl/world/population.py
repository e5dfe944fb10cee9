"""A population of nodes held as arrays: millions of node ids cost bytes, not objects.

`NodeIds` is a sequence of node ids in one uint64 array (Flower's id type);
`PartitionMap` maps node id -> partition for partitions `0 … n-1`. The local engine
assigns its nodes this way, and the round loop selects among them in partition order
without a Python object per node.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "NodeIds",
    "PartitionMap",
    "as_node_ids",
    "member",
    "nodes_by_partition",
]


class NodeIds(Sequence[int]):
    """Node ids (unsigned 64-bit, as Flower's) held as one array; items read back as Python ints.

    `partitions`, when known, is the partition each id holds: the loop's candidates come
    from the population in partition order and carry theirs, so grouping by partition
    needs no lookup.
    """

    def __init__(self, ids: np.ndarray, partitions: np.ndarray | None = None) -> None:
        self.ids = np.asarray(ids, dtype=np.uint64)
        self.partitions = partitions

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return NodeIds(self.ids[i], None if self.partitions is None else self.partitions[i])
        return int(self.ids[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids.tolist())

    def where(self, mask: np.ndarray) -> NodeIds:
        """The ids where `mask` (one bool per id) is True, in the same order (these same
        ids when it keeps all: a million-node copy is the largest cost of a round's pick)."""
        if mask.all():
            return self
        return NodeIds(self.ids[mask], None if self.partitions is None else self.partitions[mask])

    def without(self, nodes: Collection[int]) -> NodeIds:
        """These ids but `nodes`, in the same order (array operations, not a Python loop)."""
        if not nodes:
            return self
        return self.where(~member(self.ids, np.fromiter(nodes, np.uint64, len(nodes))))


def member(values: np.ndarray, of: np.ndarray) -> np.ndarray:
    """One bool per value (uint64): whether it is in `of` (a few: nodes in flight, heard from).

    A table indexed by the low bits of an id (about 8 slots per id of `of`) screens out
    nearly every value in one gather; only those landing in a used slot are looked up by
    binary search in the sorted `of`. Node ids are random, so few land there.
    """
    out = np.zeros(len(values), dtype=bool)
    if not len(of):
        return out
    known = np.sort(of.astype(np.uint64))
    mask = (1 << max((8 * len(known)).bit_length(), 10)) - 1
    used = np.zeros(mask + 1, dtype=bool)
    used[known & np.uint64(mask)] = True
    screened = np.flatnonzero(used[values & np.uint64(mask)])
    at = np.minimum(np.searchsorted(known, values[screened]), len(known) - 1)
    out[screened] = known[at] == values[screened]
    return out


def as_node_ids(nodes: Sequence[int]) -> NodeIds:
    """`nodes` as NodeIds (itself when it is one)."""
    if isinstance(nodes, NodeIds):
        return nodes
    return NodeIds(np.fromiter(nodes, dtype=np.uint64, count=len(nodes)))


class PartitionMap(Mapping[int, int]):
    """node id -> partition for partitions `0 … n-1`, from the node of each partition.

    Three 8-byte arrays (24 bytes a node) instead of a dict of Python ints; a lookup is a
    binary search, and the last few thousand answers are kept, since a round looks up each
    of its nodes several times.
    """

    RECENT = 4096  # answers kept: more than a round's nodes

    def __init__(self, by_partition: np.ndarray) -> None:
        self.by_partition = NodeIds(by_partition, np.arange(len(by_partition)))
        order = np.argsort(self.by_partition.ids, kind="stable")
        self._nodes, self._partitions = self.by_partition.ids[order], order
        if len(self._nodes) > 1 and not bool(np.all(np.diff(self._nodes) > 0)):
            raise ValueError("a node id holds several partitions")
        self._recent: dict[int, int] = {}

    def __getitem__(self, node: int) -> int:
        if not isinstance(node, int | np.integer) or isinstance(node, bool):
            raise KeyError(node)
        found = self._recent.get(node)
        if found is not None:
            return found
        try:  # searched as uint64: a Python int would make NumPy convert the whole array
            key = np.uint64(node)
        except OverflowError:  # an id outside uint64 is no node of ours
            raise KeyError(node) from None
        i = int(np.searchsorted(self._nodes, key))
        if i == len(self._nodes) or self._nodes[i] != key:
            raise KeyError(node)
        if len(self._recent) >= self.RECENT:
            self._recent.clear()
        self._recent[int(node)] = found = int(self._partitions[i])
        return found

    def __iter__(self) -> Iterator[int]:
        return iter(self._nodes.tolist())

    def __len__(self) -> int:
        return len(self._nodes)


def nodes_by_partition(partitions: Mapping[int, int], num_partitions: int) -> NodeIds:
    """The node holding each partition `0 … num_partitions-1` (each held once, as
    `discover_partitions` guarantees), in partition order."""
    if isinstance(partitions, PartitionMap):
        return partitions.by_partition
    ids = np.zeros(num_partitions, dtype=np.uint64)
    for node, partition in partitions.items():
        ids[partition] = node
    return NodeIds(ids, np.arange(num_partitions))
