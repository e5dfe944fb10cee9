"""The generated shapes task: reproducible, balanced, standardised, and every class drawn."""

import numpy as np
import pytest
import torch

from fl.world.data import load_dataset
from fl.world.procedural import SHAPES, generate_shapes


def test_same_seed_same_images_other_seed_other_images() -> None:
    a, la = generate_shapes(200, seed=3)
    b, lb = generate_shapes(200, seed=3)
    c, _ = generate_shapes(200, seed=4)
    assert np.array_equal(a, b) and np.array_equal(la, lb)
    assert not np.allclose(a, c)


def test_classes_balanced_and_images_standardised() -> None:
    x, y = generate_shapes(1000, seed=0, size=16)
    assert x.shape == (1000, 3, 16, 16) and x.dtype == np.float32
    assert np.bincount(y, minlength=len(SHAPES)).tolist() == [100] * 10
    assert abs(float(x.mean())) < 0.15 and 0.7 < float(x.std()) < 1.3


def test_each_class_has_its_own_mean_silhouette() -> None:
    """Without noise or distractors every class's average mask differs from every other's."""
    x, y = generate_shapes(2000, seed=1, noise=0.0, distractor=0.0)
    means = np.stack([np.abs(x[y == k] - x[y == k].mean()).mean(axis=(0, 1)) for k in range(10)])
    distances = np.abs(means[:, None] - means[None]).sum(axis=(2, 3))
    assert (distances + np.eye(10) * 1e9).min() > 1.0


def test_dataset_loader_splits_train_and_test() -> None:
    data = load_dataset("shapes", seed=0, train_size=300, test_size=100)
    assert data.input_shape == (3, 16, 16) and data.num_classes == 10
    assert len(data.x_train) == 300 and len(data.x_test) == 100
    assert data.y_train.dtype == torch.int64
    assert not torch.equal(data.x_train[:100], data.x_test)


@pytest.mark.parametrize("bad", [{"n": 0}, {"size": 4}])
def test_bad_sizes_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="need n >= 1"):
        generate_shapes(bad.get("n", 10), seed=0, size=bad.get("size", 16))
