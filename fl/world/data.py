"""Datasets as in-memory tensors: bundled, generated, or read from local files; never downloaded."""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl.common.files import open_regular
from fl.world.procedural import SHAPES, generate_shapes

__all__ = [
    "DATASET_NAMES",
    "DATA_DIR_ENV",
    "Dataset",
    "DatasetNotFoundError",
    "SyntheticDevices",
    "hold_out_validation",
    "load_dataset",
    "split_indices",
]

DATA_DIR_ENV = "FL_DATA_DIR"
_MNIST_MEAN, _MNIST_STD = 0.1307, 0.3081
_CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_CIFAR10_FILES = (
    *(f"data_batch_{i}" for i in range(1, 6)),
    "test_batch",
    "batches.meta",
)
_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_SYNTHETIC_MIN_SAMPLES = 10
_SYNTHETIC_SIZE_SIGMA = 1.0
_SIZES_TAG, _DEVICE_TAG, _SHARED_TAG = 0x512E, 0xDE71CE, 0x5A4ED  # seed streams of Synthetic


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held in memory as tensors (compared by identity: tensors have no `==`)."""

    name: str
    x_train: torch.Tensor  # float32, (n, *input_shape)
    y_train: torch.Tensor  # int64, (n,)
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    groups: np.ndarray | None = None  # natural client id per train sample, if any

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, without the batch dimension."""
        return tuple(self.x_train.shape[1:])


def hold_out_validation(dataset: Dataset, fraction: float, seed: int) -> Dataset:
    """`dataset` with a stratified `fraction` of its train split as the split evaluated, in
    place of its test split: what tuning measures, so no tuned choice ever sees the test
    split. Clients train on the rest."""
    labels = dataset.y_train.numpy()
    counts = np.bincount(labels, minlength=dataset.num_classes)
    stratify = labels if counts[counts > 0].min() >= 2 else None  # a class of one: plain split
    train, held = split_indices(len(labels), fraction, seed, stratify=stratify)
    train, held = np.sort(train), np.sort(held)
    return Dataset(
        name=dataset.name,
        x_train=dataset.x_train[train],
        y_train=dataset.y_train[train],
        x_test=dataset.x_train[held],
        y_test=dataset.y_train[held],
        num_classes=dataset.num_classes,
        groups=None if dataset.groups is None else dataset.groups[train],
    )


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are missing or unusable where we look; we never download them."""


def load_dataset(
    name: str, *, seed: int, root: str | Path | None = None, **options: Any
) -> Dataset:
    """Load dataset `name`; `seed` fixes any split or generation, `root` locates file-backed data.

    `root` defaults to $FL_DATA_DIR, else `data/` under the working directory. Options:
    digits: flat; synthetic: see `_load_synthetic`; mnist and cifar10: none.
    """
    loader = _LOADERS.get(name)
    if loader is None:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}")
    return loader(seed=seed, root=_data_root(root), **options)


def _data_root(root: str | Path | None) -> Path:
    """The explicit root, else $FL_DATA_DIR, else ./data."""
    if root is not None:
        return Path(root)
    return Path(os.environ.get(DATA_DIR_ENV) or Path.cwd() / "data")


def _load_digits(*, seed: int, root: Path, flat: bool = True) -> Dataset:
    """scikit-learn's bundled 8x8 digits, pixels scaled to [0, 1], stratified 80/20 split."""
    del root  # bundled with scikit-learn
    pixels, labels = _bundled_digits()
    x = (pixels / 16.0).astype(np.float32)
    if not flat:
        x = x.reshape(-1, 1, 8, 8)
    train, test = split_indices(len(labels), 0.2, seed, stratify=labels)
    return Dataset(
        name="digits",
        x_train=torch.from_numpy(x[train]),
        y_train=torch.from_numpy(labels[train].astype(np.int64)),
        x_test=torch.from_numpy(x[test]),
        y_test=torch.from_numpy(labels[test].astype(np.int64)),
        num_classes=10,
    )


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits file read as its `load_digits` reads it (pixels 0-16 as float64,
    labels), located without importing scikit-learn, which costs a process ~1 s."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotFoundError("digits ship with scikit-learn, which is not installed")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with (
        open_regular(path, max_bytes=1 << 20) as raw,
        gzip.open(raw, "rt", encoding="utf-8") as text,
    ):
        data = np.loadtxt(text, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def split_indices(
    n: int, test_size: float, seed: int, *, stratify: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices of `n` samples, draw for draw those of scikit-learn's
    `train_test_split(..., test_size=, stratify=, random_state=seed)` (its
    `StratifiedShuffleSplit`, or `ShuffleSplit` without labels), so that a run need not import
    scikit-learn (~1 s); tests/test_data.py holds them equal to scikit-learn's."""
    if not 0.0 < test_size < 1.0:
        raise ValueError(f"test_size must lie in (0, 1), got {test_size}")
    if stratify is not None and len(stratify) != n:
        raise ValueError(f"{len(stratify)} labels to stratify {n} samples")
    n_test = math.ceil(test_size * n)
    n_train = n - n_test
    rng = np.random.RandomState(seed)
    if stratify is None:
        order = rng.permutation(n)
        return order[n_test:], order[:n_test]
    classes, inverse, counts = np.unique(stratify, return_inverse=True, return_counts=True)
    if counts.min() < 2 or min(n_train, n_test) < len(classes):
        raise ValueError(
            f"a stratified split of {n} samples needs 2 of each of its {len(classes)} classes "
            f"and as many samples on each side (least class {counts.min()}, "
            f"train {n_train}, test {n_test})"
        )
    members = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    n_trains = _approximate_mode(counts, n_train, rng)
    n_tests = _approximate_mode(counts - n_trains, n_test, rng)
    train: list[np.int64] = []
    test: list[np.int64] = []
    for indices, n_tr, n_te in zip(members, n_trains, n_tests, strict=True):
        drawn = indices[rng.permutation(len(indices))]
        train.extend(drawn[:n_tr])
        test.extend(drawn[n_tr : n_tr + n_te])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of `n_draws` each class gets: its floored share, then one more to the largest
    remainders, ties broken at random (scikit-learn's `_approximate_mode`, draw for draw)."""
    continuous = counts / counts.sum() * n_draws
    floored = np.floor(continuous)
    need = int(n_draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if need <= 0:
            break
        (tied,) = np.where(remainder == value)
        add = min(len(tied), need)
        floored[rng.choice(tied, size=add, replace=False)] += 1
        need -= add
    return floored.astype(int)


@dataclass(frozen=True, eq=False)
class SyntheticDevices:
    """Synthetic(alpha, beta) of LEAF/FedProx, generated device by device.

    Constants follow the FedProx paper's description (Li et al. 2020) as recalled, not
    its released script. Per device k: u_k ~ N(0, alpha), B_k ~ N(0, beta) (alpha and
    beta used as standard deviations); W_k, b_k entries ~ N(u_k, 1); v_k entries
    ~ N(B_k, 1); x ~ N(v_k, diag(j^-1.2)); y = argmax(W_k x + b_k). `iid` (Synthetic-IID)
    shares one W, b ~ N(0, 1) and one v ~ N(0, 1) across devices. Device sizes are
    lognormal(sigma=1) with mean `samples_per_device`, at least 10; each device holds out
    round(test_fraction * size) samples, always keeping one for training.

    Device k's samples depend on (seed, k) alone, never on how many devices there are or
    which were generated before, so a population of millions costs only its size array
    (8 bytes a device) until a device is asked for.
    """

    seed: int
    num_devices: int
    alpha: float = 0.5
    beta: float = 0.5
    dim: int = 60
    num_classes: int = 10
    samples_per_device: float = 60
    test_fraction: float = 0.2
    iid: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.samples_per_device < math.inf:
            raise ValueError(
                f"samples_per_device must be > 0 and finite, got {self.samples_per_device}"
            )
        if not (0 <= self.alpha < math.inf and 0 <= self.beta < math.inf):
            raise ValueError(
                f"alpha and beta must be finite and >= 0, got {self.alpha}, {self.beta}"
            )
        if not 0 <= self.test_fraction < 1:
            raise ValueError(f"test_fraction must be in [0, 1), got {self.test_fraction}")
        if self.num_devices < 1 or self.dim < 1 or self.num_classes < 2:
            raise ValueError("synthetic needs num_devices >= 1, dim >= 1 and num_classes >= 2")

    @cached_property
    def sizes(self) -> np.ndarray:
        """Samples of each device, train and test (one seeded stream: a prefix never changes)."""
        mu = np.log(self.samples_per_device) - _SYNTHETIC_SIZE_SIGMA**2 / 2
        drawn = np.random.default_rng([self.seed, _SIZES_TAG]).lognormal(
            mu, _SYNTHETIC_SIZE_SIGMA, self.num_devices
        )
        return np.maximum(_SYNTHETIC_MIN_SAMPLES, np.rint(drawn).astype(np.int64))

    @cached_property
    def test_sizes(self) -> np.ndarray:
        """Held-out samples of each device."""
        return np.minimum(np.rint(self.test_fraction * self.sizes).astype(np.int64), self.sizes - 1)

    @cached_property
    def train_sizes(self) -> np.ndarray:
        """Training samples of each device."""
        return self.sizes - self.test_sizes

    def device(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """All samples of device `k` (float32 features, int64 labels), held-out ones first."""
        if not 0 <= k < self.num_devices:
            raise IndexError(f"device {k} of {self.num_devices}")
        rng = np.random.default_rng([self.seed, _DEVICE_TAG, k])
        if self.iid:
            w, b, v = self._shared
        else:
            u, big_b = rng.normal(0.0, self.alpha), rng.normal(0.0, self.beta)
            w, b, v = _synthetic_device(rng, u, big_b, self.num_classes, self.dim)
        x = v + rng.standard_normal((int(self.sizes[k]), self.dim)) * self._std_x
        return x.astype(np.float32), np.argmax(x @ w.T + b, axis=1).astype(np.int64)

    @cached_property
    def _shared(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The W, b and v every device shares when `iid`: drawn once from their own stream
        (a million-client run draws a few devices a round; each drew them anew)."""
        rng = np.random.default_rng([self.seed, _SHARED_TAG])
        return _synthetic_device(rng, 0.0, 0.0, self.num_classes, self.dim)

    @cached_property
    def _std_x(self) -> np.ndarray:
        """Each feature's standard deviation, the square root of its variance j^-1.2."""
        return np.arange(1, self.dim + 1) ** -0.6

    def train(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device `k`'s training samples."""
        return self._train_part(k, *self.device(k))

    def _train_part(
        self, k: int, x: np.ndarray, y: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_test = int(self.test_sizes[k])
        return torch.from_numpy(x[n_test:]), torch.from_numpy(y[n_test:])

    def dataset(self) -> Dataset:
        """Every device's samples as one Dataset; `groups` holds each train sample's device."""
        return self._assembled(self.num_devices, lazy=False)[0]

    def split(self, test_devices: int) -> tuple[Dataset, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The held-out samples of the first `test_devices` as a Dataset with an empty train
        split (clients read theirs through `train`), and those devices' training samples as
        `train` gives them: generated once for both."""
        return self._assembled(min(self.num_devices, test_devices), lazy=True)

    def _assembled(
        self, count: int, *, lazy: bool
    ) -> tuple[Dataset, list[tuple[torch.Tensor, torch.Tensor]]]:
        devices = [self.device(k) for k in range(count)]
        held_out = [np.arange(len(y)) < self.test_sizes[k] for k, (_, y) in enumerate(devices)]
        is_test = torch.from_numpy(np.concatenate(held_out))
        x_all = torch.from_numpy(np.concatenate([x for x, _ in devices]))
        y_all = torch.from_numpy(np.concatenate([y for _, y in devices]))
        train = torch.zeros_like(is_test) if lazy else ~is_test
        groups = np.repeat(np.arange(count, dtype=np.int64), self.train_sizes[:count])
        dataset = Dataset(
            name="synthetic",
            x_train=x_all[train],
            y_train=y_all[train],
            x_test=x_all[is_test],
            y_test=y_all[is_test],
            num_classes=self.num_classes,
            groups=None if lazy else groups,
        )
        trains = [self._train_part(k, x, y) for k, (x, y) in enumerate(devices)] if lazy else []
        return dataset, trains


def _load_synthetic(
    *,
    seed: int,
    root: Path,
    alpha: float = 0.5,
    beta: float = 0.5,
    num_devices: int = 20,
    dim: int = 60,
    num_classes: int = 10,
    samples_per_device: float = 60,
    test_fraction: float = 0.2,
    iid: bool = False,
) -> Dataset:
    """Synthetic(alpha, beta) of LEAF/FedProx (`SyntheticDevices`), every device in memory."""
    del root  # generated
    devices = SyntheticDevices(
        seed, num_devices, alpha, beta, dim, num_classes, samples_per_device, test_fraction, iid
    )
    return devices.dataset()


def _synthetic_device(
    rng: np.random.Generator, u: float, big_b: float, num_classes: int, dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One device's model W, b (entries ~ N(u, 1)) and feature mean v (entries ~ N(B, 1))."""
    w = rng.normal(u, 1.0, (num_classes, dim))
    b = rng.normal(u, 1.0, num_classes)
    v = rng.normal(big_b, 1.0, dim)
    return w, b, v


def _load_mnist(*, seed: int, root: Path) -> Dataset:
    """MNIST from `root/MNIST/raw` (the four uncompressed idx files), as (n, 1, 28, 28) z-scores."""
    del seed  # fixed official split
    folder = root / "MNIST" / "raw"
    _require_files(
        folder,
        _MNIST_FILES,
        "download the four MNIST idx .gz files (train/t10k images and labels), gunzip them there",
    )
    from torchvision.datasets import MNIST  # lazy: torchvision is slow to import

    splits = [MNIST(root, train=train, download=False) for train in (True, False)]
    xs = [((s.data.float() / 255 - _MNIST_MEAN) / _MNIST_STD).unsqueeze(1) for s in splits]
    return Dataset(
        name="mnist",
        x_train=xs[0],
        y_train=splits[0].targets.long(),
        x_test=xs[1],
        y_test=splits[1].targets.long(),
        num_classes=10,
    )


def _load_cifar10(*, seed: int, root: Path) -> Dataset:
    """CIFAR-10 from `root/cifar-10-batches-py`, as (n, 3, 32, 32) normalised per channel."""
    del seed  # fixed official split
    folder = root / "cifar-10-batches-py"
    _require_files(
        folder,
        _CIFAR10_FILES,
        "extract the official cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) "
        f"into {root}",
    )
    try:
        from torchvision.datasets import CIFAR10  # lazy: torchvision is slow to import

        splits = [CIFAR10(root, train=train, download=False) for train in (True, False)]
    except RuntimeError as err:  # torchvision verifies each file's MD5
        raise DatasetNotFoundError(
            f"CIFAR-10 files in {folder} fail torchvision's checksum; replace them with the "
            "official cifar-10-python.tar.gz contents"
        ) from err
    mean = torch.tensor(_CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(_CIFAR10_STD).view(1, 3, 1, 1)
    chw = [np.ascontiguousarray(s.data.transpose(0, 3, 1, 2)) for s in splits]
    xs = [(torch.from_numpy(x).float() / 255 - mean) / std for x in chw]
    ys = [torch.tensor(s.targets, dtype=torch.int64) for s in splits]
    return Dataset(
        name="cifar10",
        x_train=xs[0],
        y_train=ys[0],
        x_test=xs[1],
        y_test=ys[1],
        num_classes=10,
    )


def _require_files(folder: Path, names: tuple[str, ...], how: str) -> None:
    """Raise DatasetNotFoundError naming `folder` and what is missing, unless all files exist."""
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise DatasetNotFoundError(
            f"dataset files not found in {folder} (missing: {', '.join(missing)}); {how}. "
            f"Set task.root (or {DATA_DIR_ENV}) to look elsewhere; nothing is ever downloaded."
        )


def _load_shapes(
    *,
    seed: int,
    root: Path,
    train_size: int = 12_000,
    test_size: int = 2_000,
    **options: Any,
) -> Dataset:
    """Generated shape images (fl/world/procedural.py): a harder vision task, nothing to
    download."""
    del root  # generated
    x_train, y_train = generate_shapes(train_size, seed=seed, **options)
    x_test, y_test = generate_shapes(test_size, seed=seed + 1_000_003, **options)
    return Dataset(
        name="shapes",
        x_train=torch.from_numpy(x_train),
        y_train=torch.from_numpy(y_train),
        x_test=torch.from_numpy(x_test),
        y_test=torch.from_numpy(y_test),
        num_classes=len(SHAPES),
    )


_LOADERS: dict[str, Callable[..., Dataset]] = {
    "digits": _load_digits,
    "shapes": _load_shapes,
    "synthetic": _load_synthetic,
    "mnist": _load_mnist,
    "cifar10": _load_cifar10,
}
DATASET_NAMES = tuple(_LOADERS)
