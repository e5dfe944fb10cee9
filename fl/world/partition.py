"""Split training-sample indices across clients: iid, Dirichlet, label shards or natural groups.

NumPy only: we chose not to depend on flwr-datasets so that client installs stay lean.
Every scheme returns disjoint, sorted int64 index arrays that together cover every
sample exactly once, gives each client at least `min_size` samples (else ValueError)
and is deterministic for a seed.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SCHEMES", "partition_indices"]

SCHEMES = ("iid", "dirichlet", "shards", "natural")
_DIRICHLET_MAX_DRAWS = 100


def partition_indices(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    *,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_size: int = 2,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Indices into `labels` for each of `num_clients` clients under `scheme`.

    `alpha` is the Dirichlet concentration (dirichlet), `classes_per_client` the shards
    per client (shards), `groups` the natural client id of each sample (natural).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if len(labels) < num_clients * min_size:
        raise ValueError(
            f"{len(labels)} samples cannot give {num_clients} clients {min_size} each "
            f"(min_size): use at most {len(labels) // max(min_size, 1)} clients"
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(len(labels)), num_clients)
    elif scheme == "dirichlet":
        parts = _dirichlet(labels, num_clients, rng, alpha, min_size)
    elif scheme == "shards":
        parts = _shards(labels, num_clients, rng, classes_per_client)
    else:
        parts = _natural(labels, num_clients, groups)
    result = [np.sort(part).astype(np.int64) for part in parts]
    smallest = min(len(part) for part in result)
    if smallest < min_size:
        raise ValueError(
            f"scheme {scheme!r} left a client with {smallest} samples, fewer than "
            f"min_size={min_size}; use fewer clients or a smaller min_size"
        )
    return result


def _dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_size: int,
) -> list[np.ndarray]:
    """Per class, split its samples by Dirichlet(alpha) proportions (Hsu et al. 2019).

    Redraws the whole split until every client holds `min_size` samples, a bounded
    number of times, as flwr-datasets' DirichletPartitioner does.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    by_class = [np.flatnonzero(labels == label) for label in np.unique(labels)]
    for _ in range(_DIRICHLET_MAX_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for members in by_class:
            shuffled = rng.permutation(members)
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(proportions)[:-1] * len(shuffled)).astype(np.int64)
            for client, chunk in enumerate(np.split(shuffled, cuts)):
                parts[client].append(chunk)
        merged = [np.concatenate(chunks) for chunks in parts]
        if min(len(part) for part in merged) >= min_size:
            return merged
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) draw in {_DIRICHLET_MAX_DRAWS} gave all {num_clients} "
        f"clients >= {min_size} samples; raise alpha, lower min_size or use fewer clients"
    )


def _shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    classes_per_client: int,
) -> list[np.ndarray]:
    """Pathological non-IID (McMahan et al. 2017): each client gets `classes_per_client` shards.

    Shards are cut within each class (counts proportional to class size, at least one
    each), so a shard holds one label and a client at most `classes_per_client` labels.
    """
    if classes_per_client < 1:
        raise ValueError(f"classes_per_client must be >= 1, got {classes_per_client}")
    num_shards = num_clients * classes_per_client
    classes = np.unique(labels)
    if num_shards < len(classes):
        raise ValueError(
            f"{num_clients} clients x {classes_per_client} shards cannot hold all "
            f"{len(classes)} classes; raise num_clients or classes_per_client"
        )
    sizes = np.array([np.count_nonzero(labels == label) for label in classes])
    # One shard per class, the rest by largest remainder of the class's share.
    quota = sizes / sizes.sum() * (num_shards - len(classes))
    counts = 1 + np.floor(quota).astype(np.int64)
    leftover = num_shards - int(counts.sum())
    counts[np.argsort(np.floor(quota) - quota, kind="stable")[:leftover]] += 1
    shards = [
        shard
        for label, count in zip(classes, counts, strict=True)
        for shard in np.array_split(rng.permutation(np.flatnonzero(labels == label)), count)
    ]
    order = rng.permutation(num_shards).reshape(num_clients, classes_per_client)
    return [np.concatenate([shards[s] for s in row]) for row in order]


def _natural(labels: np.ndarray, num_clients: int, groups: np.ndarray | None) -> list[np.ndarray]:
    """One client per natural group (e.g. a synthetic dataset's devices), in group-id order."""
    if groups is None:
        raise ValueError(
            "scheme 'natural' needs groups (a client id per sample); this dataset has none"
        )
    groups = np.asarray(groups)
    if groups.shape != labels.shape:
        raise ValueError(f"groups has shape {groups.shape} but labels {labels.shape}")
    ids = np.unique(groups)
    if len(ids) != num_clients:
        raise ValueError(
            f"scheme 'natural' makes one client per group: the data has {len(ids)} groups "
            f"but num_clients={num_clients}"
        )
    return [np.flatnonzero(groups == group) for group in ids]
