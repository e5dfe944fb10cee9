"""One reply for a whole cohort: its members' trained rows stacked, their metrics as lists.

A cohort (`clients.cohort`, `engine.cohort=auto`) trains N members as one program and
holds their trained models as one N x D float32 tensor. Instead of N Flower Messages
(each member's row encoded into its own arrays, then taken apart again on the server),
the cohort answers with one Message:

- `cohort-rows`: an ArrayRecord with one Array `rows`, the N x D rows (float32);
- `cohort-metrics`: a MetricRecord of lists, one entry per member, in member order
  (`num-examples`, `train-loss`, `steps`, `samples`, `partition-id`, the echoed nonce);
- `cohort`: a ConfigRecord with `node-ids`, the member nodes in the same order (decimal
  strings: a node id is a uint64, which a ConfigRecord's signed integers cannot hold).

Everything in it is untrusted: `parse_cohort` checks the shapes, counts, ids and list
types against what the server knows (the model's width, the nodes it asked) and raises
ValueError with one reason; the per-member checks (nonce, finiteness, norms, metric
ranges) are the strategy's (`ServerStrategy.accept`). A member whose row or metrics fail
is rejected alone; a reply whose structure fails is rejected whole.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fl.wire.codec import Traffic
from fl.wire.records import array_to_numpy, new_record, numpy_to_array, record_of, value_bytes

__all__ = [
    "COHORT",
    "COHORT_METRICS",
    "COHORT_ROWS",
    "CohortReply",
    "cohort_node_ids",
    "is_cohort_reply",
    "member_traffic",
    "pack_cohort",
    "parse_cohort",
]

COHORT, COHORT_ROWS, COHORT_METRICS = "cohort", "cohort-rows", "cohort-metrics"
ROWS = "rows"
IDS = "node-ids"


def pack_cohort(
    rows: torch.Tensor, node_ids: Sequence[int], metrics: Mapping[str, Sequence[Any]]
) -> RecordDict:
    """The content of a cohort's reply: `rows` (N x D float32, one copy into the Array),
    the members' `node_ids` and their `metrics` (each a list of N ints or N floats)."""
    rows = rows.detach()
    if rows.dim() != 2 or rows.dtype != torch.float32 or rows.shape[0] != len(node_ids):
        raise ValueError(f"cohort rows {tuple(rows.shape)} {rows.dtype} for {len(node_ids)} nodes")
    array = numpy_to_array(np.ascontiguousarray(rows.cpu().numpy()))
    columns = new_record(MetricRecord, {k: list(v) for k, v in metrics.items()})
    ids = new_record(ConfigRecord, {IDS: [str(int(n)) for n in node_ids]})  # uint64: text
    arrays = new_record(ArrayRecord, {ROWS: array})
    return new_record(RecordDict, {COHORT_ROWS: arrays, COHORT_METRICS: columns, COHORT: ids})


def is_cohort_reply(content: RecordDict) -> bool:
    """Whether a reply's content is a cohort's (it carries the `cohort` record)."""
    return COHORT in content


def cohort_node_ids(content: RecordDict, asked: Collection[int]) -> list[int]:
    """The member nodes a cohort reply names, checked: a list of distinct ints, each a
    node that was asked (`asked`), at most `len(asked)` of them; ValueError otherwise."""
    record = record_of(content, COHORT, ConfigRecord)
    listed = record.get(IDS) if record is not None else None
    if not isinstance(listed, list) or not listed:
        raise ValueError("cohort reply: no 'node-ids' list")
    if len(listed) > len(asked):
        raise ValueError(f"cohort reply names {len(listed)} nodes, {len(asked)} were asked")
    if not all(isinstance(n, str) and n.isdecimal() and n.isascii() for n in listed):
        raise ValueError("cohort reply: node ids are not decimal strings")
    ids = [int(n) for n in listed]
    if len(set(ids)) != len(ids):
        raise ValueError("cohort reply names a node twice")
    unknown = next((n for n in ids if n not in asked), None)
    if unknown is not None:
        raise ValueError(f"cohort reply names node {unknown!r}, which was not asked")
    return ids


def member_traffic(content: RecordDict, members: int) -> Traffic:
    """Bytes one member's share of a cohort reply put on the link: its row (what its own
    dense reply would carry); never raises (a malformed reply counts what it holds)."""
    arrays = record_of(content, COHORT_ROWS, ArrayRecord)
    if arrays is None or ROWS not in arrays or members <= 0:
        return Traffic(0)
    try:
        held = value_bytes(arrays[ROWS])
    except (ValueError, TypeError):
        held = len(arrays[ROWS].data)
    return Traffic(held // members)


@dataclass(frozen=True)
class CohortReply:
    """A parsed cohort reply: the member nodes, their rows (N x D, a copy of the reply's
    buffer) and each metric's column (N entries)."""

    node_ids: list[int]
    rows: torch.Tensor
    metrics: dict[str, list[Any]]


def parse_cohort(content: RecordDict, width: int, asked: Collection[int]) -> CohortReply:
    """A cohort reply checked against the model's `width` (D) and the nodes `asked`: N
    distinct asked node ids, an N x D float32 array, metric lists of N numbers each."""
    ids = cohort_node_ids(content, asked)
    arrays = record_of(content, COHORT_ROWS, ArrayRecord)
    if arrays is None or list(arrays.keys()) != [ROWS]:
        raise ValueError("cohort reply: 'cohort-rows' must hold exactly one array 'rows'")
    rows = array_to_numpy(arrays[ROWS])  # checks the bytes hold what the array declares
    if rows.dtype != np.float32 or rows.shape != (len(ids), width):
        raise ValueError(
            f"cohort reply: rows are {rows.dtype} {rows.shape}, "
            f"expected float32 {(len(ids), width)} ({len(ids)} nodes x the model's {width})"
        )
    record = record_of(content, COHORT_METRICS, MetricRecord)
    if record is None:
        raise ValueError("cohort reply has no 'cohort-metrics' record")
    metrics: dict[str, list[Any]] = {}
    for key, column in record.items():
        if not isinstance(column, list) or len(column) != len(ids):
            raise ValueError(f"cohort reply: metric {key!r} is not a list of {len(ids)} values")
        metrics[key] = column
    return CohortReply(ids, torch.from_numpy(rows.copy()), metrics)  # one copy: a writable stack
