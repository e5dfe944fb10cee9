"""Tests for fl.world.data: bundled, generated and file-backed datasets, none downloaded."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.datasets.cifar
import torchvision.datasets.mnist

from fl.world.data import (
    DATA_DIR_ENV,
    DATASET_NAMES,
    Dataset,
    DatasetNotFoundError,
    hold_out_validation,
    load_dataset,
    split_indices,
)
from fl.world.task import DATASETS


@pytest.fixture(autouse=True)
def _no_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt by torchvision to fetch data fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tried to download")

    for module in (torchvision.datasets.cifar, torchvision.datasets.mnist):
        monkeypatch.setattr(module, "download_and_extract_archive", refuse)


def _device_label_tv(ds: Dataset) -> float:
    """Mean total-variation distance between each device's label histogram and the pooled one."""
    assert ds.groups is not None
    y = ds.y_train.numpy()
    pooled = np.bincount(y, minlength=ds.num_classes) / len(y)
    dists = [
        0.5
        * np.abs(
            np.bincount(y[ds.groups == g], minlength=ds.num_classes) / np.sum(ds.groups == g)
            - pooled
        ).sum()
        for g in np.unique(ds.groups)
    ]
    return float(np.mean(dists))


# --- digits -----------------------------------------------------------------------------


def test_digits_is_a_stratified_80_20_split_of_scaled_pixels() -> None:
    ds = load_dataset("digits", seed=0)
    assert (ds.x_train.shape, ds.x_test.shape) == ((1437, 64), (360, 64))
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.input_shape == (64,) and ds.num_classes == 10 and ds.groups is None
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0
    per_class = torch.bincount(ds.y_test, minlength=10).numpy()
    total = per_class + torch.bincount(ds.y_train, minlength=10).numpy()
    assert np.all(np.abs(per_class - 0.2 * total) <= 1)


def test_digits_split_follows_the_seed() -> None:
    a, b, c = (load_dataset("digits", seed=s) for s in (1, 1, 2))
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)


def test_digits_unflattened_for_cnns() -> None:
    flat = load_dataset("digits", seed=0)
    image = load_dataset("digits", seed=0, flat=False)
    assert image.input_shape == (1, 8, 8) and image.x_test.shape == (360, 1, 8, 8)
    assert torch.equal(image.x_train.reshape(-1, 64), flat.x_train)


def test_digits_are_scikit_learns_digits_split_as_train_test_split_splits_them() -> None:
    # Read and split without importing scikit-learn (a second a process): the same arrays.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    for seed in (0, 1, 7):
        ds = load_dataset("digits", seed=seed)
        x = (bunch.data / 16.0).astype(np.float32)
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, bunch.target, test_size=0.2, stratify=bunch.target, random_state=seed
        )
        assert np.array_equal(ds.x_train.numpy(), x_tr) and np.array_equal(ds.x_test.numpy(), x_te)
        assert np.array_equal(ds.y_train.numpy(), y_tr) and np.array_equal(ds.y_test.numpy(), y_te)


@pytest.mark.parametrize("stratified", [True, False])
def test_split_indices_draw_what_train_test_split_draws(stratified: bool) -> None:
    from sklearn.model_selection import train_test_split

    rng = np.random.default_rng(3)
    for trial in range(40):
        n = int(rng.integers(30, 400))
        labels = rng.integers(0, int(rng.integers(2, 9)), size=n)  # uneven classes, tied shares
        labels[: 2 * 9] = np.repeat(np.arange(9), 2) % (labels.max() + 1)  # 2+ of each class
        size = float(rng.choice([0.1, 0.2, 0.25, 0.33, 0.5]))
        stratify = labels if stratified else None
        ours = split_indices(n, size, trial, stratify=stratify)
        theirs = train_test_split(
            np.arange(n), test_size=size, stratify=stratify, random_state=trial
        )
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)), trial


def test_split_indices_refuse_what_cannot_be_stratified() -> None:
    with pytest.raises(ValueError, match="needs 2 of each"):
        split_indices(10, 0.2, 0, stratify=np.array([0] * 9 + [1]))
    with pytest.raises(ValueError, match="test_size"):
        split_indices(10, 1.0, 0)
    with pytest.raises(ValueError, match="9 labels to stratify 10"):
        split_indices(10, 0.2, 0, stratify=np.array([0, 1] * 4 + [0]))


def test_the_held_out_split_is_stratified_and_disjoint() -> None:
    ds = load_dataset("digits", seed=0)
    held = hold_out_validation(ds, 0.25, seed=4)
    assert len(held.y_train) + len(held.y_test) == len(ds.y_train)
    assert len(held.y_test) == int(np.ceil(0.25 * len(ds.y_train)))
    per_class = np.bincount(held.y_test.numpy(), minlength=10)
    assert np.all(np.abs(per_class - 0.25 * np.bincount(ds.y_train.numpy(), minlength=10)) <= 1)
    rows = {tuple(r) for r in held.x_train.numpy().round(4)}
    assert not any(tuple(r) in rows for r in held.x_test.numpy().round(4)[:50] if r.any())


# --- synthetic --------------------------------------------------------------------------


def test_synthetic_shapes_groups_and_holdout() -> None:
    ds = load_dataset("synthetic", seed=0, num_devices=30, dim=12, num_classes=5)
    assert ds.input_shape == (12,) and ds.num_classes == 5
    assert ds.x_train.dtype == torch.float32 and ds.y_test.dtype == torch.int64
    assert ds.groups is not None and ds.groups.dtype == np.int64
    assert len(ds.groups) == len(ds.y_train)
    train_sizes = np.bincount(ds.groups, minlength=30)
    assert np.all(train_sizes >= 8)  # at least 10 per device, 2 of them held out
    assert np.all(np.diff(ds.groups) >= 0)  # train samples are stored device by device
    total = len(ds.y_train) + len(ds.y_test)
    assert abs(len(ds.y_test) - 0.2 * total) <= 0.5 * 30
    assert int(ds.y_train.min()) >= 0 and int(ds.y_train.max()) < 5


def test_synthetic_device_sizes_average_samples_per_device() -> None:
    ds = load_dataset("synthetic", seed=0, num_devices=5000, dim=2, samples_per_device=60)
    mean_size = (len(ds.y_train) + len(ds.y_test)) / 5000
    assert 57 < mean_size < 63  # lognormal mean 60, nudged up by the floor of 10
    assert ds.groups is not None
    sizes = np.bincount(ds.groups)
    assert sizes.min() >= 8 and sizes.max() > 3 * 60  # heavy-tailed, like LEAF


def test_synthetic_is_deterministic_per_seed() -> None:
    a, b, c = (load_dataset("synthetic", seed=s) for s in (5, 5, 6))
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.groups is not None and b.groups is not None
    assert np.array_equal(a.groups, b.groups)
    assert not torch.equal(a.y_train[:50], c.y_train[:50])


def test_synthetic_features_have_the_prescribed_variances() -> None:
    # In the IID variant all devices share v, so the pooled variance of feature j is j^-1.2.
    ds = load_dataset("synthetic", seed=0, iid=True, num_devices=50, samples_per_device=100)
    var = ds.x_train.double().var(dim=0).numpy()
    expected = np.arange(1, 61) ** -1.2
    np.testing.assert_allclose(var, expected, rtol=0.15)


def test_synthetic_non_iid_devices_disagree_on_labels_iid_ones_do_not() -> None:
    non_iid, iid = (
        _device_label_tv(
            load_dataset("synthetic", seed=0, iid=flag, num_devices=40, samples_per_device=200)
        )
        for flag in (False, True)
    )
    assert non_iid > 0.5 and iid < 0.1


def test_synthetic_rejects_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match="samples_per_device must be > 0"):
        load_dataset("synthetic", seed=0, samples_per_device=0)


def test_unknown_dataset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="digits, shapes, synthetic, mnist, cifar10"):
        load_dataset("femnist", seed=0)
    assert DATASET_NAMES == DATASETS  # the config check accepts exactly what loads


# --- file-backed: missing files --------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "folder"), [("cifar10", "cifar-10-batches-py"), ("mnist", "MNIST/raw")]
)
def test_missing_files_name_the_expected_path(tmp_path: Path, name: str, folder: str) -> None:
    with pytest.raises(DatasetNotFoundError, match="nothing is ever downloaded") as info:
        load_dataset(name, seed=0, root=tmp_path)
    assert str(tmp_path / folder) in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_data_root_comes_from_env_then_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(
        DatasetNotFoundError, match=str(tmp_path / "elsewhere" / "cifar-10-batches-py")
    ):
        load_dataset("cifar10", seed=0)
    monkeypatch.delenv(DATA_DIR_ENV)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetNotFoundError, match=str(tmp_path / "data" / "MNIST" / "raw")):
        load_dataset("mnist", seed=0)


# --- file-backed: fake files in the official layouts ------------------------------------


def _write_cifar(root: Path, per_batch: int) -> None:
    """CIFAR-10's layout: pickled dicts of uint8 "data" (n, 3072) and "labels" per batch.

    The official files are Python 2 pickles whose byte-string keys torchvision decodes
    as latin-1 str, so str keys here are what it sees either way.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        data = np.zeros((per_batch, 3072), dtype=np.uint8)
        data[:, :1024] = 255  # red channel saturated, green and blue black
        batch = {"data": data, "labels": [(i + k) % 10 for k in range(per_batch)]}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": [f"class{k}" for k in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))


def _lenient_checksum(fpath: str, md5: str | None = None) -> bool:
    return Path(fpath).is_file()


def test_fake_cifar10_loads_normalised_per_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_cifar(tmp_path, per_batch=4)
    # torchvision checks each file's MD5 against the official archive; fakes cannot pass.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", _lenient_checksum)
    ds = load_dataset("cifar10", seed=0, root=tmp_path)
    assert (ds.x_train.shape, ds.x_test.shape) == ((20, 3, 32, 32), (4, 3, 32, 32))
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.y_train[:8].tolist() == [0, 1, 2, 3, 1, 2, 3, 4]
    assert ds.y_test.tolist() == [5, 6, 7, 8]
    expected = [(1 - 0.4914) / 0.2470, (0 - 0.4822) / 0.2435, (0 - 0.4465) / 0.2616]
    for channel, value in enumerate(expected):
        assert torch.allclose(ds.x_train[:, channel], torch.tensor(value), atol=1e-5)


def test_fake_cifar10_failing_checksum_is_reported(tmp_path: Path) -> None:
    _write_cifar(tmp_path, per_batch=1)
    with pytest.raises(DatasetNotFoundError, match="checksum"):
        load_dataset("cifar10", seed=0, root=tmp_path)


def _write_idx(path: Path, array: np.ndarray) -> None:
    """IDX file as MNIST ships it: magic (0, 0, uint8 type 0x08, ndim), big-endian dims, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">i4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_fake_mnist_loads_as_normalised_images(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 6), ("t10k", 3)):
        images = np.zeros((n, 28, 28), dtype=np.uint8)
        images[:, 0, 0] = 255
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    ds = load_dataset("mnist", seed=0, root=tmp_path)
    assert (ds.x_train.shape, ds.x_test.shape) == ((6, 1, 28, 28), (3, 1, 28, 28))
    assert ds.y_train.tolist() == [0, 1, 2, 3, 4, 5] and ds.y_test.dtype == torch.int64
    assert torch.allclose(ds.x_train[:, 0, 0, 0], torch.tensor((1 - 0.1307) / 0.3081))
    assert torch.allclose(ds.x_train[:, 0, 0, 1], torch.tensor(-0.1307 / 0.3081))
