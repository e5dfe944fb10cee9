"""Flower's own message-API strategies (`flwr.serverapp.strategy.<Name>`) through our loop.

`fl-run strategy=flower strategy.flower_class=FedAvgM strategy.kwargs.server_momentum=0.9`
runs Flower's class for what it is good at, the aggregation and any server-side optimizer
(momentum, Adam, Yogi, Adagrad, q-FedAvg's weighting, Krum's selection), while our loop
keeps what Flower lacks: seeded per-node selection, replies decoded and validated before
they reach the model (bounded example counts, finite values, norm bounds), byte and
virtual-time accounting, checkpoints, and every engine.

How the two meet, per round:
  1. `configure_train` runs the Flower class's own `configure_train` on a grid with no
     nodes: it sends nothing but does its side effects (FedAvgM/FedOpt/QFedAvg remember
     the current model; FedProx writes `proximal-mu` into the config). The config keys it
     added go into every node's instruction; our base class builds the messages.
  2. `aggregate` hands the accepted replies to the Flower class's `aggregate_train` as
     plain dense messages (`arrays` + `metrics` with `num-examples` and `train-loss`), in
     partition order; its result becomes the new global model. When it declines (Bulyan
     with too few replies) the global model is kept (`aggregation_skipped`).

Resume: the server-side state of each class, read from flwr 1.42's source, is listed in
`SUPPORTED` (FedAvgM's momentum and current model; FedAdam/FedAdagrad/FedYogi's m_t and
v_t); it is arrays only, so it is checkpointed as tensors and every supported class
resumes exactly. The other classes keep nothing between rounds. Classes outside
`SUPPORTED` (the XGBoost strategies, the DP wrappers) are refused by name: their payloads
or constructor arguments do not fit this adapter.

The client half is plain local SGD, plus FedProx's proximal term when the instruction
carries Flower's `proximal-mu`.
"""

from __future__ import annotations

import gc
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast, get_type_hints

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flower_strategies
from flwr.serverapp.strategy import FedAvg
from torch import nn

# the checks every strategy's params get (fl.common.config.has_type), applied to the Flower kwargs
from fl.common.config import has_type, type_name
from fl.strategy.client import ClientHooks
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.records import vector_to_arrays
from strategies.fedprox import FedProxHooks, FedProxParams

__all__ = ["SUPPORTED", "FlowerHooks", "FlowerParams", "FlowerStrategy", "flower_class"]

T = TypeVar("T")
# Flower class -> attributes holding its state between rounds (flwr 1.42's source).
SUPPORTED: dict[str, tuple[str, ...]] = {
    "FedAvg": (),
    "FedAvgM": ("current_arrays", "momentum_vector"),
    "FedProx": (),
    "FedAdam": ("m_t", "v_t"),
    "FedAdagrad": ("m_t", "v_t"),
    "FedYogi": ("m_t", "v_t"),
    "FedMedian": (),
    "FedTrimmedAvg": (),
    "Krum": (),
    "MultiKrum": (),
    "Bulyan": (),
    "QFedAvg": (),  # its current model is set again by every configure_train
}
# Constructor arguments our loop decides (selection, record keys, metrics), never kwargs.
LOOP_OWNED = {
    "fraction_train": "clients_per_round selects the nodes",
    "fraction_evaluate": "the server evaluates the global model itself",
    "min_train_nodes": "clients_per_round selects the nodes",
    "min_evaluate_nodes": "the server evaluates the global model itself",
    "min_available_nodes": "the run waits for num_clients nodes",
    "weighted_by_key": "replies are weighted by their bounded num-examples",
    "arrayrecord_key": "our messages carry 'arrays'",
    "configrecord_key": "our messages carry 'config'",
    "train_metrics_aggr_fn": "the loop reports the mean train loss",
    "evaluate_metrics_aggr_fn": "the server evaluates the global model itself",
    "selection_rule": "not configurable from a config file",
    "train_loss_key": "our clients report 'train-loss'",
}
# What the loop fixes of the keys above when it builds the Flower object.
FIXED: dict[str, Any] = {
    "fraction_train": 1.0,
    "min_train_nodes": 0,
    "min_evaluate_nodes": 0,
    "min_available_nodes": 0,
    "train_loss_key": "train-loss",
}
# Robust rules whose tolerance num_malicious_nodes f needs this many replies per round.
MIN_REPLIES = {"Krum": (2, 3), "MultiKrum": (2, 3), "Bulyan": (4, 3)}  # a f + b


def flower_class(name: str) -> type[FedAvg]:
    """The supported Flower strategy class called `name`; ValueError naming the key if not."""
    if name not in SUPPORTED:
        raise ValueError(
            f"strategy.flower_class: {name!r} is not a supported Flower strategy; "
            f"one of {sorted(SUPPORTED)}"
        )
    return cast(type[FedAvg], getattr(flower_strategies, name))


@dataclass
class FlowerParams:
    """flower_class: a name in `SUPPORTED`; kwargs: its constructor's algorithm arguments."""

    flower_class: str = "FedAvg"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Unknown class, unknown, loop-owned, missing or ill-typed kwargs fail by key."""
        cls = flower_class(self.flower_class)
        signature = inspect.signature(cls.__init__)
        hints = get_type_hints(cls.__init__)
        known = sorted(n for n in signature.parameters if n != "self" and n not in LOOP_OWNED)
        for key, value in self.kwargs.items():
            if key in LOOP_OWNED:
                raise ValueError(f"strategy.kwargs.{key}: set by our loop ({LOOP_OWNED[key]})")
            if key not in signature.parameters:
                raise ValueError(
                    f"strategy.kwargs.{key}: {self.flower_class} has no such argument; "
                    f"known: {known}"
                )
            if key in hints and not has_type(value, hints[key]):
                raise ValueError(
                    f"strategy.kwargs.{key}={value!r}: {self.flower_class} expects "
                    f"{type_name(hints[key])}"
                )
        for name, parameter in signature.parameters.items():
            required = parameter.default is inspect.Parameter.empty and name != "self"
            if required and name not in self.kwargs:
                raise ValueError(f"strategy.kwargs.{name}: required by {self.flower_class}")
        try:
            self.build()
        except (TypeError, ValueError) as err:
            raise ValueError(f"strategy.kwargs: {self.flower_class} refused them: {err}") from err

    def build(self) -> FedAvg:
        """A fresh Flower strategy object with these kwargs and the loop's fixed keys."""
        cls = flower_class(self.flower_class)
        accepted = inspect.signature(cls.__init__).parameters
        fixed = {k: v for k, v in FIXED.items() if k in accepted}
        return cls(**fixed, **self.kwargs)

    def validate_run(self, cfg: Any) -> None:
        """The run's keys this class depends on: the aggregation rule (the Flower class is
        the rule) and enough replies per round for a robust class's num_malicious_nodes."""
        aggregation = cfg.aggregation.name
        if aggregation != "mean":
            raise ValueError(
                f"aggregation={aggregation!r}: strategy=flower aggregates with its Flower "
                "class; use aggregation=mean (flower_class=FedMedian, Krum, ... are the rules)"
            )
        a, b = MIN_REPLIES.get(self.flower_class, (0, 1))
        malicious = int(self.kwargs.get("num_malicious_nodes", 0))
        if cfg.clients_per_round < a * malicious + b:
            raise ValueError(
                f"clients_per_round={cfg.clients_per_round}: {self.flower_class} with "
                f"num_malicious_nodes={malicious} needs >= {a * malicious + b} replies per round"
            )


class _NoNodes:
    """A grid with no nodes: the Flower class's configure_train runs its side effects only."""

    def get_node_ids(self) -> list[int]:
        return []


def _to_state(value: Any) -> Any:
    """Flower's state values (ArrayRecord, lists/dicts of ndarrays) as tensors, for torch.save."""
    if isinstance(value, ArrayRecord):
        return {"array-record": {k: torch.from_numpy(a.numpy()) for k, a in value.items()}}
    if isinstance(value, dict):
        return {k: torch.from_numpy(np.asarray(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [torch.from_numpy(np.asarray(v)) for v in value]
    return value  # None


def _from_state(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"array-record"}:
        return ArrayRecord({k: Array(t.numpy()) for k, t in value["array-record"].items()})
    if isinstance(value, dict):
        return {k: t.numpy() for k, t in value.items()}
    if isinstance(value, list):
        return [t.numpy() for t in value]
    return value


@contextmanager
def _quiet_flower() -> Iterator[None]:
    """Flower's INFO lines silenced for the call: its strategy logs `Sampled 0 nodes (out
    of 0)` and `Received N results` every round, which under our loop (a grid without
    nodes, our own per-round table) only interleave noise; its warnings still show."""
    flower = logging.getLogger("flwr")
    level = flower.level
    flower.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        flower.setLevel(level)


def _young_gc(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` with the objects alive now exempt from garbage collection.

    Flower's `ArrayRecord.to_numpy_ndarrays(keep_input=False)` (QFedAvg, Bulyan) runs a full
    `gc.collect()` per record: with torch loaded that scans the whole heap, about 0.3 s per
    reply. Frozen objects are skipped, so each collection sees only what Flower just made.
    """
    gc.freeze()
    try:
        return function(*args)
    finally:
        gc.unfreeze()


class FlowerStrategy(ServerStrategy):
    """Our loop's contract around one of Flower's strategy objects (`self.flower`)."""

    params: FlowerParams

    def __init__(self, params: FlowerParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.flower = params.build()
        self._config_keys: dict[str, Any] = {}

    def on_round_start(self, server_round: int) -> None:
        """Flower's configure_train on this round's global model, for its side effects
        (FedOpt keeps the arrays it sends) and the config keys it adds."""
        assert self.layout is not None
        arrays = vector_to_arrays(self.global_vector, self.layout)
        probe = ConfigRecord()
        with _quiet_flower():
            sent = self.flower.configure_train(server_round, arrays, probe, cast(Grid, _NoNodes()))
        assert not list(sent), "a grid without nodes gets no messages"
        self._config_keys = {k: v for k, v in probe.items() if k != "server-round"}

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        """The keys the Flower class adds to its instructions (FedProx: `proximal-mu`)."""
        return dict(self._config_keys)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        """The Flower class's aggregate_train on the accepted, bounded replies."""
        assert self.layout is not None
        replies = [
            Message(
                RecordDict(
                    {
                        "arrays": vector_to_arrays(u.vector, self.layout),
                        "metrics": MetricRecord(
                            {
                                "num-examples": u.num_examples,
                                "train-loss": float(u.metrics.get("train-loss", 0.0)),
                            }
                        ),
                    }
                ),
                u.node_id,
                MessageType.TRAIN,
            )
            for u in updates
        ]
        with _quiet_flower():
            arrays, _ = _young_gc(self.flower.aggregate_train, server_round, replies)
        if arrays is None:  # Bulyan with fewer than 4f + 3 replies
            self.stats.skipped = True
            return self.global_vector
        return self.layout.flatten(arrays.to_torch_state_dict()).to(self.global_vector.dtype)

    def state_dict(self) -> dict[str, Any]:
        """Ours plus the Flower object's state between rounds, as tensors."""
        names = SUPPORTED[self.params.flower_class]
        flower = {name: _to_state(getattr(self.flower, name)) for name in names}
        return {**super().state_dict(), "flower": flower}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, the Flower object's state included."""
        super().load_state_dict(state)
        for name, value in state["flower"].items():
            setattr(self.flower, name, _from_state(value))


class FlowerHooks(ClientHooks):
    """Plain local SGD, plus FedProx's proximal term when the server sends `proximal-mu`."""

    cohort_safe = True

    def begin(self, model: nn.Module, config: ConfigRecord, state: RecordDict) -> None:
        mu = float(cast(float, config.get("proximal-mu", 0.0)))
        self.proximal = FedProxHooks(FedProxParams(mu=mu)) if mu > 0 else None
        if self.proximal is not None:
            self.proximal.begin(model, config, state)

    def proximal_pull(self) -> tuple[float, list[torch.Tensor]] | None:
        return None if self.proximal is None else self.proximal.proximal_pull()

    def before_step(self, model: nn.Module) -> None:
        if self.proximal is not None:
            self.proximal.before_step(model)


STRATEGY = register("flower", server=FlowerStrategy, client=FlowerHooks, params=FlowerParams)
