"""Plots of a run: accuracy against rounds, cumulative bytes and virtual time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["plot_diagnostic", "plot_run", "plot_runs"]

Rows = Sequence[Mapping[str, Any]]


def plot_runs(runs: Mapping[str, Rows], path: Path, *, title: str = "") -> None:
    """One figure, three panels, one line per named run."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    for label, rows in runs.items():
        acc = [r["accuracy"] for r in rows]
        axes[0].plot([r["round"] for r in rows], acc, label=label)
        axes[1].plot(
            [(r["cum_bytes_up"] + r["cum_bytes_down"]) / 1e6 for r in rows], acc, label=label
        )
        axes[2].plot([r["virtual_time_s"] for r in rows], acc, label=label)
    xlabels = ("round", "cumulative traffic, up + down (MB)", "virtual time (s)")
    for ax, xlabel in zip(axes, xlabels, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_run(rows: Rows, path: Path, *, title: str = "") -> None:
    """The three panels for a single run."""
    plot_runs({title or "run": rows}, path, title=title)


def plot_diagnostic(runs: Mapping[str, Rows], key: str, path: Path, *, title: str = "") -> None:
    """One strategy diagnostic (e.g. frozen_fraction) against rounds, one line per run."""
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for label, rows in runs.items():
        points = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
    ax.set_xlabel("round")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
