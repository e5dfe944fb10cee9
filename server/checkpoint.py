"""Atomic checkpoints: written to a temporary file, fsynced, then renamed over the old one.

A crash at any moment leaves either the previous checkpoint or the new one, never a
torn file.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["load_checkpoint", "restore_rng", "rng_state", "save_checkpoint"]


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch global RNG states."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what `rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint` (our own file, so full unpickling)."""
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path}; to resume, pass "
            "hydra.run.dir=<the interrupted run's directory>"
        )
    payload: dict[str, Any] = torch.load(path, weights_only=False)
    return payload
