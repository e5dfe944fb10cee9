"""A run's learning task: the dataset, its split across clients, and the model.

Built once per process and cached, so thousands of simulated clients in one process
share one copy of the data and one model instance per thread. Synthetic data split by
its natural devices is generated client by client when asked for (`SyntheticDevices`),
so a population of millions costs its size array, not its samples.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from fl.common.config import ConfigError, check_choice, check_int, check_number, plain, require
from fl.common.run_slot import RunSlot
from fl.wire.records import Layout
from fl.world.data import (
    Dataset,
    DatasetNotFoundError,
    SyntheticDevices,
    hold_out_validation,
    load_dataset,
)
from fl.world.models import build_model
from fl.world.partition import SCHEMES, partition_indices

__all__ = [
    "DATASETS",
    "EVALUATION_SPLITS",
    "GPU_MEMORY_FRACTION",
    "MODELS",
    "NoDeviceError",
    "Task",
    "check_task",
    "get_task",
    "memory_bytes",
    "resolve_device",
]


EVALUATION_SPLITS = ("test", "validation")  # validation: held out of train, for tuning
DATASETS = ("digits", "shapes", "synthetic", "mnist", "cifar10")
MODELS = ("logreg", "mlp", "cnn", "lenet5", "resnet18")
GPU_MEMORY_FRACTION = "FL_GPU_MEMORY_FRACTION"  # env: this process's share of its GPU
# Generated-per-client data: the global test split is the held-out samples of this many
# first devices (all of them in smaller populations), so evaluation cost stays bounded.
EVAL_DEVICES = 1000


class NoDeviceError(ConfigError, RuntimeError):
    """device=cuda where no GPU is visible (a RuntimeError too, as it was before)."""


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; `cuda` without a GPU fails clearly.

    A process uses the first GPU it can see: pin one per SuperNode by starting it with
    `CUDA_VISIBLE_DEVICES=<index>` (its ClientApp processes inherit the variable). Where
    several processes share a GPU, `FL_GPU_MEMORY_FRACTION` caps each one's allocator.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise NoDeviceError(
            "invalid config: device='cuda': no CUDA device is visible to this process; "
            "use device=auto (a GPU where there is one) or device=cpu"
        )
    device = torch.device(name)
    if device.type == "cuda":
        _cap_gpu_memory(os.environ.get(GPU_MEMORY_FRACTION))
    return device


@lru_cache(maxsize=1)
def _cap_gpu_memory(fraction: str | None) -> None:
    """Limit this process's CUDA caching allocator to `fraction` of the device, once."""
    if fraction is None:
        return
    try:
        value = float(fraction)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise ValueError(f"{GPU_MEMORY_FRACTION}={fraction!r}: must be a number in (0, 1]")
    torch.cuda.set_per_process_memory_fraction(value, torch.cuda.current_device())


# Generated clients are kept once made where the whole population's training data fits in
# this (known from the sizes alone, before any client is made): every round after the first
# reads them instead of drawing them again. A larger population (a million devices, a few
# of them a round) is generated per use, as before: its clients rarely repeat.
GENERATED_CACHE_BYTES = 256 * 2**20


@dataclass
class Task:
    """Data, partitions and model factory of one run.

    `partitions` index the dataset's train split per client; they are None where each
    client's data is generated on demand (`devices`), and the train split is empty.
    """

    dataset: Dataset
    partitions: list[np.ndarray] | None
    model_name: str
    hidden: tuple[int, ...]
    seed: int
    device: torch.device
    devices: SyntheticDevices | None = None
    _local: threading.local = field(default_factory=threading.local, repr=False)
    _generated: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    def new_model(self) -> nn.Module:
        """A freshly initialised model, identical for a given seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = build_model(
                self.model_name,
                self.dataset.input_shape,
                self.dataset.num_classes,
                hidden=self.hidden,
            )
        return model.to(self.device)

    def model(self) -> nn.Module:
        """This thread's reusable model instance (its weights are overwritten per client)."""
        if not hasattr(self._local, "model"):
            self._local.model = self.new_model()
            self.layout.bind(self._local.model)  # load and read it in one copy each
        model: nn.Module = self._local.model
        return model

    @cached_property
    def layout(self) -> Layout:
        """Layout of the model's state_dict."""
        return Layout.of(self.model().state_dict())

    @cached_property
    def sizes(self) -> np.ndarray:
        """Training examples of each client (int64), known without building any client."""
        if self.devices is not None:
            return self.devices.train_sizes
        assert self.partitions is not None
        return np.array([len(p) for p in self.partitions], dtype=np.int64)

    @cached_property
    def _keeps_generated(self) -> bool:
        """Whether every generated client's training data fits in GENERATED_CACHE_BYTES."""
        assert self.devices is not None
        per_sample = self.devices.dim * 4 + 8  # float32 features, an int64 label
        return int(self.devices.train_sizes.sum()) * per_sample <= GENERATED_CACHE_BYTES

    def build_clients(self) -> int:
        """Every generated client's training data made now, where the population fits the
        cache (as `client_data` would make it, device by device): a run whose first round
        trains every client builds its population before that round, as a loaded dataset
        is built before training. Returns the clients built (0: not a generated task, or
        too large to keep)."""
        if self.devices is None or not self._keeps_generated:
            return 0
        for partition in range(self.devices.num_devices):
            self.client_data(partition)
        return self.devices.num_devices

    def keep_generated(self, trains: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The first clients' training data, made with the test set (`SyntheticDevices.split`):
        kept where the population fits the cache, as `client_data` would keep it."""
        if self.devices is not None and self._keeps_generated:
            for partition, (x, y) in enumerate(trains):
                self._generated[partition] = x.to(self.device), y.to(self.device)

    def client_data(self, partition: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The train tensors of one client, on the task's device."""
        if self.devices is not None:
            kept = self._generated.get(partition)
            if kept is not None:
                return kept
            x, y = self.devices.train(partition)
            made = x.to(self.device), y.to(self.device)
            if self._keeps_generated:
                self._generated[partition] = made
            return made
        assert self.partitions is not None
        index = torch.from_numpy(self.partitions[partition])
        x = self.dataset.x_train[index].to(self.device)
        y = self.dataset.y_train[index].to(self.device)
        return x, y


def _build(key: str) -> Task:
    spec = json.loads(key)
    task, part = spec["task"], spec["partition"]
    device = resolve_device(spec["device"])
    options = dict(task.get("options") or {})
    if task["dataset"] == "synthetic":
        options.setdefault("num_devices", spec["num_clients"])
    if task["model"] in ("cnn", "lenet5", "resnet18") and task["dataset"] == "digits":
        options.setdefault("flat", False)
    if task["dataset"] == "synthetic" and part["scheme"] == "natural":
        return _generated(spec, options, device)
    if task["dataset"] == "synthetic":
        _refuse_unless_it_fits(options, part["scheme"])
    try:
        dataset = load_dataset(task["dataset"], seed=spec["seed"], root=task.get("root"), **options)
    except DatasetNotFoundError as err:
        raise ConfigError(f"invalid config: task.dataset={task['dataset']!r}: {err}") from err
    except ValueError as err:
        raise ConfigError(f"invalid config: task.options of {task['dataset']}: {err}") from err
    if spec["evaluate_on"] == "validation":
        dataset = hold_out_validation(dataset, spec["validation_fraction"], spec["seed"])
    try:
        partitions = partition_indices(
            dataset.y_train.numpy(),
            spec["num_clients"],
            part["scheme"],
            seed=spec["seed"],
            **{k: v for k, v in part.items() if k != "scheme"},
            groups=dataset.groups,
        )
    except ValueError as err:
        raise ConfigError(
            f"invalid config: num_clients={spec['num_clients']}: partition={part['scheme']} "
            f"of {task['dataset']}: {err}"
        ) from err
    return Task(
        dataset,
        partitions,
        task["model"],
        tuple(task.get("hidden") or ()),
        spec["seed"],
        device,
    )


def memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _refuse_unless_it_fits(options: dict, scheme: str) -> None:
    """Synthetic data split by any scheme but its devices is generated whole, in memory:
    refuse before generating what this machine cannot hold (1,000,000 devices: ~45 GB)."""
    values = [options.get(k, d) for k, d in (("num_devices", 20), ("samples_per_device", 60))]
    dim = options.get("dim", 60)
    if not all(isinstance(v, int | float) and v > 0 for v in (*values, dim)):
        return  # SyntheticDevices names the bad option
    # float32 features and an int64 label per sample, about 3x that at the peak (measured:
    # 3.6 GB for 80,000 devices of 60 samples of dim 60)
    need = 3 * values[0] * values[1] * (4 * dim + 8)
    if need > memory_bytes():
        raise ConfigError(
            f"invalid config: partition={scheme} of synthetic generates all "
            f"{values[0]:,} devices in memory, about {need / 1e9:.0f} GB, more than this "
            f"machine's {memory_bytes() / 1e9:.0f} GB; use partition=natural (one client per "
            "device, generated when asked for) or fewer clients"
        )


def _generated(spec: dict, options: dict, device: torch.device) -> Task:
    """Synthetic split by its devices: client p is device p, generated when asked for."""
    task, clients = spec["task"], spec["num_clients"]
    try:
        devices = SyntheticDevices(seed=spec["seed"], **options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid config: task.options of synthetic: {err}") from err
    if devices.num_devices != clients:
        raise ConfigError(
            f"invalid config: num_clients={clients}: partition=natural makes one client per "
            f"device, but task.options.num_devices={devices.num_devices}"
        )
    dataset, trains = devices.split(EVAL_DEVICES)
    hidden = tuple(task.get("hidden") or ())
    made = Task(dataset, None, task["model"], hidden, spec["seed"], device, devices)
    made.keep_generated(trains)
    return made


_RUN_TASK: RunSlot[Task] = RunSlot()  # a run asks for it several times (preflight, server, clients)


def get_task(cfg: DictConfig) -> Task:
    """The task of a run config, built on first use in this process (another run's task, a
    sweep's previous job's, is let go first)."""
    spec = {
        "task": plain(cfg.task),
        "partition": plain(cfg.partition),
        "num_clients": cfg.num_clients,
        "seed": cfg.seed,
        "device": cfg.device,
        "evaluate_on": cfg.get("evaluate_on", "test"),
        "validation_fraction": cfg.get("validation_fraction", 0.1),
    }
    key = json.dumps(spec, sort_keys=True)
    return _RUN_TASK.get(key, lambda: _build(key))


def check_task(cfg: DictConfig) -> None:
    """Dataset, model, its hidden widths and the partition scheme with its parameters."""
    check_choice(cfg, "task.dataset", DATASETS)
    check_choice(cfg, "task.model", MODELS)
    hidden = OmegaConf.select(cfg, "task.hidden")
    require(
        hidden is None
        or (
            isinstance(hidden, ListConfig | list)
            and all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in hidden)
        ),
        "task.hidden",
        hidden,
        "must be a list of layer widths, integers >= 1, e.g. [64] or [128,64]",
    )
    check_choice(cfg, "partition.scheme", SCHEMES)
    scheme = cfg.partition.scheme
    check_choice(cfg, "evaluate_on", EVALUATION_SPLITS)
    check_number(cfg, "validation_fraction", 0, 0.5, strict=True)
    require(
        cfg.evaluate_on == "test" or scheme != "natural",
        "evaluate_on",
        cfg.evaluate_on,
        "needs a train split to hold out from; synthetic devices generated one by one have "
        "none (use partition=iid or dirichlet of synthetic to tune)",
    )
    if OmegaConf.select(cfg, "partition.min_size") is not None:
        check_int(cfg, "partition.min_size", 1)  # every client gets an example
    if scheme == "dirichlet":
        check_number(cfg, "partition.alpha", 0, strict=True)
    if scheme == "shards":
        check_int(cfg, "partition.classes_per_client", 1)
    if scheme == "natural":
        require(cfg.task.dataset == "synthetic", "partition.scheme", scheme, "needs task=synthetic")
