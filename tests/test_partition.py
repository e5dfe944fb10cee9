"""Tests for fl.world.partition: coverage, determinism, skew and per-scheme guarantees."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fl.world.partition import SCHEMES, partition_indices

LABELS = np.random.default_rng(0).integers(0, 10, 1000)
GROUPS = np.repeat(np.arange(10), 100)


def _split(scheme: str, seed: int = 0, **kwargs: Any) -> list[np.ndarray]:
    return partition_indices(LABELS, 10, scheme, seed=seed, groups=GROUPS, **kwargs)


def _mean_distinct_labels(parts: list[np.ndarray]) -> float:
    return float(np.mean([len(np.unique(LABELS[p])) for p in parts]))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_covers_each_index_exactly_once(scheme: str) -> None:
    parts = _split(scheme)
    assert len(parts) == 10
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
def test_random_schemes_are_deterministic_per_seed(scheme: str) -> None:
    same = zip(_split(scheme, seed=3), _split(scheme, seed=3), strict=True)
    assert all(np.array_equal(a, b) for a, b in same)
    other = zip(_split(scheme, seed=3), _split(scheme, seed=4), strict=True)
    assert not all(np.array_equal(a, b) for a, b in other)


def test_iid_sizes_differ_by_at_most_one() -> None:
    sizes = [len(p) for p in partition_indices(LABELS[:997], 10, "iid", seed=0)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 997


def test_small_dirichlet_alpha_skews_labels_more_than_large() -> None:
    skewed = _mean_distinct_labels(_split("dirichlet", alpha=0.05))
    even = _mean_distinct_labels(_split("dirichlet", alpha=100.0))
    assert even == 10.0
    assert skewed < 5.0


def test_dirichlet_redraws_until_min_size_holds() -> None:
    unconstrained = partition_indices(LABELS, 20, "dirichlet", seed=1, alpha=0.3, min_size=0)
    assert min(len(p) for p in unconstrained) < 20  # so the bound below is doing work
    parts = partition_indices(LABELS, 20, "dirichlet", seed=1, alpha=0.3, min_size=20)
    assert min(len(p) for p in parts) >= 20


def test_dirichlet_gives_up_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="raise alpha"):
        partition_indices(LABELS[:100], 10, "dirichlet", seed=0, alpha=0.01, min_size=10)


@pytest.mark.parametrize("classes_per_client", [1, 2, 3])
def test_shards_bound_labels_per_client(classes_per_client: int) -> None:
    parts = _split("shards", classes_per_client=classes_per_client)
    assert max(len(np.unique(LABELS[p])) for p in parts) <= classes_per_client
    sizes = [len(p) for p in parts]
    assert max(sizes) <= 2 * min(sizes)  # shards are near-equal, so clients are too


def test_shards_cover_imbalanced_classes_within_the_label_bound() -> None:
    labels = np.repeat(np.arange(10), [500, 200, 100, 50, 50, 40, 30, 20, 5, 5])
    parts = partition_indices(labels, 10, "shards", seed=0, classes_per_client=2)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(1000))
    assert max(len(np.unique(labels[p])) for p in parts) <= 2


def test_shards_need_room_for_every_class() -> None:
    with pytest.raises(ValueError, match="cannot hold all 10 classes"):
        partition_indices(LABELS, 4, "shards", seed=0, classes_per_client=2)


def test_natural_gives_one_client_per_group() -> None:
    groups = np.random.default_rng(1).permutation(GROUPS)
    parts = partition_indices(LABELS, 10, "natural", seed=0, groups=groups)
    assert [np.unique(groups[p]).tolist() for p in parts] == [[g] for g in range(10)]


def test_natural_rejects_missing_or_mismatched_groups() -> None:
    with pytest.raises(ValueError, match="needs groups"):
        partition_indices(LABELS, 10, "natural", seed=0)
    with pytest.raises(ValueError, match="10 groups but num_clients=5"):
        partition_indices(LABELS, 5, "natural", seed=0, groups=GROUPS)


def test_too_few_samples_for_min_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_size"):
        partition_indices(LABELS[:15], 10, "iid", seed=0, min_size=2)


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="iid, dirichlet, shards, natural"):
        partition_indices(LABELS, 10, "pathological", seed=0)
