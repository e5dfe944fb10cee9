"""Robust aggregation and the bound on claimed example counts, chosen by configuration.

`ServerStrategy.aggregate` hands the accepted client vectors and their (bounded) example
counts to an `Aggregator`, so every strategy that aggregates through the base class (all of
ours: APF, GIFT and PAS call it for the averaging step) gets the configured rule:

- `mean`: the example-weighted mean (FedAvg); ours, in float64, bit-identical to before.
- `median`: coordinate-wise median, unweighted (Flower's `FedMedian`): Flower's
  `flwr.server.strategy.aggregate.aggregate_median`.
- `trimmed_mean`: per coordinate, drop `trim_beta` of each tail and average the rest
  (`FedTrimmedAvg`): Flower's `flwr.serverapp.strategy.fedtrimmedavg.trim_mean`.
- `krum`: the one vector whose squared distances to its n-f-2 nearest sum least (`Krum`):
  Flower's `flwr.serverapp.strategy.multikrum.select_multikrum`.
- `multikrum`: the `num_selected` best Krum scores (default n-f), example-weighted mean
  (`MultiKrum`): Flower's `select_multikrum`, then the mean above.
- `bulyan`: Multi-Krum picks n-2f, then per coordinate the mean of the n-4f values closest
  to their median (`Bulyan`): Flower's `select_multikrum` and
  `flwr.serverapp.strategy.bulyan.aggregate_n_closest_weights`.

Flower's strategies take `Message`s holding `ArrayRecord`s; ours hold one flat vector per
client, so the Krum selection gets each vector wrapped as a one-array `RecordDict`, and the
coordinate-wise rules get the stacked vectors (coordinate-wise rules do not care how the
coordinates are split into tensors). `f` is `num_malicious`. Krum needs n >= 2f+3 replies,
Bulyan n >= 4f+3: configuration refuses a `clients_per_round` below that, and a round with
fewer accepted replies (faults, rejections) keeps the global model, as Flower's Bulyan does.

Example counts: a client's `num-examples` weighs its update in the mean, so it is bounded
by what the server knows (`ExampleBounds`, built by `example_bounds` from the task's
partition sizes and the node → partition map of the run, capped by
`max_examples_per_client`); a claim above the bound is clipped to it (see
`ServerStrategy.check_reply`). Median, trimmed mean, Krum and Bulyan ignore counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict
from flwr.server.strategy.aggregate import aggregate_median
from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum
from omegaconf import DictConfig, OmegaConf

from fl.common.config import check_choice, check_int, check_number, plain, require
from fl.wire.records import numpy_to_array

if TYPE_CHECKING:
    from fl.world.task import Task

__all__ = [
    "AGGREGATIONS",
    "NORM_POLICIES",
    "Aggregator",
    "ExampleBounds",
    "check_aggregation",
    "example_bounds",
    "median_claim",
    "min_replies",
    "robust_options",
    "weighted_mean",
]

AGGREGATIONS = ("mean", "median", "trimmed_mean", "krum", "multikrum", "bulyan")
NORM_POLICIES = ("reject", "clip")


def min_replies(name: str, num_malicious: int) -> int:
    """Fewest replies a rule needs to tolerate `num_malicious` attackers (1 for the rest)."""
    if name in ("krum", "multikrum"):
        return 2 * num_malicious + 3
    if name == "bulyan":
        return 4 * num_malicious + 3
    return 1


def weighted_mean(vectors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Example-weighted mean of the rows of `vectors` (FedAvg), summed in float64."""
    weights = weights.double()
    return ((weights / weights.sum()) @ vectors.double()).float()


def _krum_select(vectors: np.ndarray, num_malicious: int, keep: int) -> list[int]:
    """Rows chosen by Flower's Multi-Krum selection (`keep`=1: Krum), best score first."""
    contents = [RecordDict({"arrays": ArrayRecord({"v": numpy_to_array(v)})}) for v in vectors]
    chosen = select_multikrum(contents, num_malicious, keep)
    row = {id(content): i for i, content in enumerate(contents)}
    return [row[id(content)] for content in chosen]


@dataclass(frozen=True)
class Aggregator:
    """One aggregation rule and its parameters (`conf/aggregation/NAME.yaml`)."""

    name: str = "mean"
    trim_beta: float = 0.2  # trimmed_mean: fraction cut from each tail, in [0, 0.5)
    num_malicious: int = 0  # krum, multikrum, bulyan: attackers f the rule must tolerate
    num_selected: int | None = None  # multikrum: vectors averaged (None: n - f)

    @property
    def min_replies(self) -> int:
        """Fewest accepted replies this rule aggregates; fewer keep the global model."""
        return min_replies(self.name, self.num_malicious)

    def __call__(self, vectors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The new global vector from client vectors (n x d) and example counts (n)."""
        if self.name == "mean":
            return weighted_mean(vectors, weights)
        rows = vectors.float().numpy()
        f = self.num_malicious
        if self.name == "median":
            out = aggregate_median([([row], 1) for row in rows])[0]
        elif self.name == "trimmed_mean":
            out = trim_mean(rows, self.trim_beta)
        elif self.name == "krum":
            return vectors[_krum_select(rows, f, 1)[0]].float().clone()
        elif self.name == "multikrum":
            keep = min(self.num_selected or max(1, len(rows) - f), len(rows))
            chosen = _krum_select(rows, f, keep)
            return weighted_mean(vectors[chosen], weights[chosen])
        elif self.name == "bulyan":
            theta = len(rows) - 2 * f
            selected = rows[_krum_select(rows, f, theta)]
            median = np.median(selected, axis=0)
            beta = theta - 2 * f
            out = aggregate_n_closest_weights([median], [[s] for s in selected], beta)[0]
        else:
            raise ValueError(f"unknown aggregation {self.name!r}; one of {list(AGGREGATIONS)}")
        return torch.from_numpy(np.asarray(out, dtype=np.float32).copy())

    @classmethod
    def from_config(cls, options: Mapping[str, Any]) -> Aggregator:
        """The rule of an `aggregation` config node (keys other rules use are ignored)."""
        selected = options.get("num_selected")
        return cls(
            name=str(options.get("name", "mean")),
            trim_beta=float(options.get("trim_beta", 0.2)),
            num_malicious=int(options.get("num_malicious", 0)),
            num_selected=None if selected is None else int(selected),
        )


@dataclass(frozen=True)
class ExampleBounds:
    """The most examples each node's reply may claim: what the server knows, never the reply.

    `per_node`: node id -> bound (its partition's size, capped by `cap`); `cap`: the bound
    of a node outside the map (`max_examples_per_client`), or None, in which case such a
    node's claim is cut to the median claim of its round ("robust normalisation": it can
    weigh no more than a typical client).
    """

    per_node: Mapping[int, int] = field(default_factory=dict)
    cap: int | None = None

    def limit(self, node_id: int) -> int | None:
        """The bound of one node; None if the server knows none."""
        return self.per_node.get(node_id, self.cap)


def example_bounds(
    cfg: DictConfig, task: Task | None, partitions: Mapping[int, int]
) -> ExampleBounds:
    """Bounds of a run: each node's partition size (from the server's own task and node map),
    capped by `max_examples_per_client` when that is set."""
    cap = cfg.get("max_examples_per_client")
    cap = None if cap is None else int(cap)
    sizes = task.sizes if task is not None else np.empty(0, dtype=np.int64)
    return ExampleBounds(_PartitionBounds(partitions, sizes, cap), cap)


class _PartitionBounds(Mapping[int, int]):
    """node -> its partition's size capped by `cap`, looked up when asked: a population of
    millions needs no per-node table."""

    def __init__(self, partitions: Mapping[int, int], sizes: np.ndarray, cap: int | None) -> None:
        self.partitions, self.sizes, self.cap = partitions, sizes, cap

    def __getitem__(self, node: int) -> int:
        partition = self.partitions[node]
        if not 0 <= partition < len(self.sizes):  # a size the server does not know
            if self.cap is None:
                raise KeyError(node)
            return self.cap
        size = int(self.sizes[partition])
        return size if self.cap is None else min(size, self.cap)

    def __iter__(self) -> Iterator[int]:
        return iter(self.partitions)

    def __len__(self) -> int:
        return len(self.partitions)


def robust_options(cfg: DictConfig) -> dict[str, Any]:
    """Keyword arguments of `ServerStrategy` for the run's aggregation and norm policy."""
    aggregation = cfg.get("aggregation")
    return {
        "aggregator": Aggregator.from_config(plain(aggregation) if aggregation else {}),
        "update_norm_policy": str(cfg.get("update_norm_policy", "reject")),
    }


def median_claim(claims: list[int]) -> int:
    """The median of a round's example counts, rounded up (the cap of unbounded nodes)."""
    return max(1, math.ceil(float(np.median(claims)))) if claims else 1


def check_aggregation(cfg: DictConfig) -> None:
    """Aggregation rule, norm policy and example cap; a rule that cannot tolerate its
    num_malicious with clients_per_round replies is refused here, not in round 1."""
    check_choice(cfg, "aggregation.name", AGGREGATIONS)
    check_choice(cfg, "update_norm_policy", NORM_POLICIES)
    if cfg.get("max_examples_per_client") is not None:
        check_int(cfg, "max_examples_per_client", 1)
    name = cfg.aggregation.name
    if name == "trimmed_mean":
        check_number(cfg, "aggregation.trim_beta", 0, 0.5)
        beta = cfg.aggregation.trim_beta
        require(beta < 0.5, "aggregation.trim_beta", beta, "must be < 0.5")
    if name in ("krum", "multikrum", "bulyan"):
        check_int(cfg, "aggregation.num_malicious", 0)
        need = min_replies(name, cfg.aggregation.num_malicious)
        require(
            cfg.clients_per_round >= need,
            "clients_per_round",
            cfg.clients_per_round,
            f"aggregation={name} with num_malicious={cfg.aggregation.num_malicious} needs "
            f">= {need} replies per round ({'4f+3' if name == 'bulyan' else '2f+3'})",
        )
    if name == "multikrum" and OmegaConf.select(cfg, "aggregation.num_selected") is not None:
        check_int(cfg, "aggregation.num_selected", 1, cfg.clients_per_round)
