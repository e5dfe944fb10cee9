"""Procedural images: a generated vision task harder than digits, with no files to download.

Ten classes of shapes (disk, ring, square, frame, triangle, cross, X, horizontal bars,
vertical bars, checkerboard) drawn at a random position, scale and colour over a random
textured background with pixel noise, plus a faint distractor shape of another class.
Difficulty grows with `noise` and `distractor`; the defaults put a small CNN well below
what it reaches on digits (see experiments/RESULTS.md, "Headroom"). Everything follows
from `seed`, so every machine generates the same images.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["SHAPES", "generate_shapes"]

Mask = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def _disk(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    return u**2 + v**2 <= r**2


def _ring(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    d = np.sqrt(u**2 + v**2)
    return (d <= r) & (d >= 0.6 * r)


def _square(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    return np.maximum(abs(u), abs(v)) <= 0.85 * r


def _frame(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    d = np.maximum(abs(u), abs(v))
    return (d <= 0.85 * r) & (d >= 0.55 * r)


def _triangle(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    return (v <= 0.6 * r) & (v >= 1.7 * abs(u) - r)


def _cross(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    w = 0.3 * r
    return ((abs(u) <= w) & (abs(v) <= r)) | ((abs(v) <= w) & (abs(u) <= r))


def _x(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    return _cross((u - v) / np.sqrt(2), (u + v) / np.sqrt(2), r)


def _hbars(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    return (np.maximum(abs(u), abs(v)) <= r) & (np.floor(2.5 * v / r) % 2 == 0)


def _vbars(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    return _hbars(v, u, r)


def _checker(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    cells = np.floor(2 * u / r) + np.floor(2 * v / r)
    return (np.maximum(abs(u), abs(v)) <= r) & (cells % 2 == 0)


SHAPES: tuple[Mask, ...] = (
    _disk,
    _ring,
    _square,
    _frame,
    _triangle,
    _cross,
    _x,
    _hbars,
    _vbars,
    _checker,
)


def _masks(
    labels: np.ndarray, size: int, rng: np.random.Generator, scale: float = 1.0
) -> np.ndarray:
    """(n, size, size) boolean masks of each label's shape at a random place, scale, turn."""
    n = len(labels)
    grid = (np.arange(size) + 0.5) / size * 2 - 1  # pixel centres in [-1, 1]
    y, x = np.meshgrid(grid, grid, indexing="ij")
    centre = rng.uniform(-0.35, 0.35, size=(n, 2, 1, 1))
    radius = scale * rng.uniform(0.35, 0.65, size=(n, 1, 1))
    angle = rng.uniform(-0.35, 0.35, size=(n, 1, 1))  # a small tilt; shapes stay nameable
    dx, dy = x - centre[:, 0], y - centre[:, 1]
    u = np.cos(angle) * dx + np.sin(angle) * dy
    v = -np.sin(angle) * dx + np.cos(angle) * dy
    out = np.zeros((n, size, size), dtype=bool)
    for label, shape in enumerate(SHAPES):
        rows = labels == label
        if rows.any():
            out[rows] = shape(u[rows], v[rows], radius[rows])
    return out


def generate_shapes(
    n: int,
    *,
    seed: int,
    size: int = 16,
    noise: float = 0.35,
    distractor: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """`n` standardised images (n, 3, size, size) float32 and their labels, classes balanced.

    `noise` is the pixel noise's standard deviation; `distractor` the contrast of a second,
    smaller shape of another class (0: none).
    """
    if n < 1 or size < 8:
        raise ValueError(f"need n >= 1 and size >= 8, got n={n}, size={size}")
    rng = np.random.default_rng([seed, 0x5A9E])
    labels = rng.permutation(np.arange(n) % len(SHAPES))
    background = rng.uniform(0, 1, size=(n, 3, 1, 1))
    foreground = rng.uniform(0, 1, size=(n, 3, 1, 1))
    # Keep the shape visible: push its colour away from the background's.
    foreground = np.where(abs(foreground - background) < 0.3, 1 - foreground, foreground)
    texture = rng.normal(0, 0.08, size=(n, 3, size // 4, size // 4))
    texture = texture.repeat(4, axis=2).repeat(4, axis=3)
    images = background + texture
    shape = _masks(labels, size, rng)[:, None]
    images = np.where(shape, foreground, images)
    if distractor > 0:
        other = (labels + rng.integers(1, len(SHAPES), size=n)) % len(SHAPES)
        small = _masks(other, size, rng, scale=0.6)[:, None]
        tint = rng.uniform(0, 1, size=(n, 3, 1, 1))
        images = np.where(small & ~shape, (1 - distractor) * images + distractor * tint, images)
    images = images + rng.normal(0, noise, size=images.shape)
    images = (images - 0.5) / np.sqrt(1 / 12 + noise**2)  # about zero mean, unit variance
    return images.astype(np.float32), labels.astype(np.int64)
