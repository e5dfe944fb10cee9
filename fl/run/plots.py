"""Plots of a run: accuracy against rounds, cumulative bytes and virtual time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fl.common.files import write_atomic
from fl.run.intervals import ACCURACY, interval

__all__ = ["plot_diagnostic", "plot_run", "plot_runs"]

Rows = Sequence[Mapping[str, Any]]


def _save(fig: Any, path: Path) -> None:
    """`fig` as a PNG at `path`, never through a link (fl.common.files)."""
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def _traffic_mb(row: Mapping[str, Any]) -> float:
    return float(row["cum_bytes_up"] + row["cum_bytes_down"]) / 1e6


X_AXES = (lambda r: float(r["round"]), _traffic_mb, lambda r: float(r["virtual_time_s"]))


def plot_runs(runs: Mapping[str, Sequence[Rows]], path: Path, *, title: str = "") -> None:
    """One figure, three panels, one line per named arm: its run, or the mean over its
    seeds' runs (row by row, up to the shortest) in a band of the mean's 95 % t-interval,
    clipped to accuracy's range [0, 1]. Rows: the evaluated ones (`fl.run.tracking`)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    for label, seeds in runs.items():
        rounds = min(len(rows) for rows in seeds)
        per_round = [[rows[i] for rows in seeds] for i in range(rounds)]
        stats = [interval([r["accuracy"] for r in rows], bounds=ACCURACY) for rows in per_round]
        mean = [m for m, _, _ in stats]
        for ax, x_of in zip(axes, X_AXES, strict=True):
            xs = [sum(x_of(r) for r in rows) / len(rows) for rows in per_round]
            (line,) = ax.plot(
                xs, mean, label=label if len(seeds) == 1 else f"{label} ({len(seeds)} seeds)"
            )
            if len(seeds) > 1:
                low, high = [lo for _, lo, _ in stats], [hi for _, _, hi in stats]
                ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    xlabels = ("round", "cumulative traffic, up + down (MB)", "virtual time (s)")
    for ax, xlabel in zip(axes, xlabels, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    _save(fig, path)


def plot_run(rows: Rows, path: Path, *, title: str = "") -> None:
    """The three panels for a single run."""
    plot_runs({title or "run": [rows]}, path, title=title)


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
    _save(fig, path)
