"""Run outputs: metrics.jsonl, summary.json, the plot, and Weights & Biases (optional).

One JSON object per round goes to `metrics.jsonl`; the same rows go to W&B when
`logger=wandb` (offline unless WANDB_MODE says otherwise). A resumed run truncates
the file from the checkpoint's rows (the checkpoint is the record; the file is its copy,
so a torn or lost last line cannot falsify a resume) and continues it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from fl.common.config import check_choice, plain
from fl.common.errors import RunError
from fl.common.files import (
    make_dir,
    open_for_append,
    require_regular,
    require_writable,
    write_atomic,
)

__all__ = [
    "CONTROL_KEYS",
    "LOGGERS",
    "RUN_FILES",
    "RunLog",
    "check_logger",
    "clear_run",
    "evaluated",
    "holds_run",
    "reached_target",
    "refuse_existing_run",
    "run_defining",
    "summarize",
]
Row = TypeVar("Row", bound=Mapping[str, Any])

# Overrides that say how one invocation treats its run folder or its console, never what
# the run is: none is saved with a run, replayed by `resume=latest`, or part of an arm's
# label (a resumed sweep passes resume=true to the arms it starts fresh too, and one arm
# may be rerun with progress=false: their saved command lines must label them alike).
CONTROL_KEYS = ("resume", "overwrite", "progress", "plots")


def run_defining(overrides: list[str]) -> list[str]:
    """`overrides` without the invocation's own controls and display switches (CONTROL_KEYS)."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in CONTROL_KEYS]


# What a run leaves in its directory; any of them means the directory holds a run.
LOGGERS = ("jsonl", "wandb")
RUN_FILES = (
    "metrics.jsonl",
    "summary.json",
    "checkpoint.pt",
    "checkpoint.prev.pt",
    "model.pt",
    "config.yaml",
    "accuracy.png",
)


def holds_run(out_dir: Path) -> bool:
    """Whether `out_dir` holds outputs of a run (started, killed or finished)."""
    return any((out_dir / name).exists() for name in RUN_FILES)


def refuse_existing_run(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a fresh run in a directory that holds another run's outputs, and
    any run in one where a run file is not a regular file (a FIFO, a directory)."""
    for name in RUN_FILES:
        require_regular(out_dir / name)
        require_writable(out_dir / name)  # a link is never written through, nor followed
        require_writable(out_dir / f"{name}.tmp")
    require_writable(out_dir / "run.log")  # Hydra's log: LogFile wrote nothing through it
    if not resume and not overwrite and holds_run(out_dir):
        raise RunError(
            f"{out_dir} already holds a run; pass resume=true to continue it, overwrite=true "
            "to replace it, or choose another hydra.run.dir"
        )


def clear_run(out_dir: Path) -> None:
    """Remove a previous run's outputs (`overwrite=true`), so nothing of it mixes in."""
    for name in RUN_FILES:
        (out_dir / name).unlink(missing_ok=True)


def evaluated(rows: Iterable[Row]) -> list[Row]:
    """The rows of rounds whose global model was evaluated (all, unless `evaluate_every` > 1;
    the run's last round always is)."""
    return [row for row in rows if "accuracy" in row]


def reached_target(rows: list[dict[str, Any]], target: float, window: int) -> dict[str, Any] | None:
    """The first row whose trailing mean accuracy over `window` evaluated rounds (fewer in
    the first rounds) reaches `target`: one lucky round does not count, so an arm of many
    short rounds gets no more chances to cross on noise than one of few long rounds."""
    recent: list[float] = []
    for row in evaluated(rows):
        recent = [*recent[-(window - 1) :], row["accuracy"]] if window > 1 else [row["accuracy"]]
        if sum(recent) / len(recent) >= target:
            return row
    return None


def summarize(
    rows: list[dict[str, Any]], target_accuracy: float | None, window: int = 1
) -> dict[str, Any]:
    """Totals of a run, and how long it took to reach `target_accuracy` if it did (by the
    trailing mean over `window` rounds, `target_window`)."""
    if not rows:
        return {"rounds": 0}
    last, scored = rows[-1], evaluated(rows)  # a run's last round is always evaluated
    summary: dict[str, Any] = {
        "rounds": last["round"],
        "final_accuracy": scored[-1]["accuracy"],
        "final_loss": scored[-1]["loss"],
        "best_accuracy": max(r["accuracy"] for r in scored),
        "total_bytes_up": last["cum_bytes_up"],
        "total_bytes_down": last["cum_bytes_down"],
        "total_payload_bytes_up": last["cum_payload_bytes_up"],
        "total_payload_bytes_down": last["cum_payload_bytes_down"],
        "virtual_time_s": last["virtual_time_s"],
        "wall_time_s": last["wall_time_s"],
    }
    if target_accuracy is not None:
        hit = reached_target(rows, target_accuracy, window)
        summary["target_accuracy"] = target_accuracy
        summary["target_window"] = window
        summary["rounds_to_target"] = hit["round"] if hit else None
        summary["bytes_to_target"] = hit["cum_bytes_up"] + hit["cum_bytes_down"] if hit else None
        summary["time_to_target_s"] = hit["virtual_time_s"] if hit else None
    return summary


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLog:
    """Writes one run's outputs into its directory."""

    def __init__(
        self, out_dir: Path, cfg: DictConfig, rows: list[dict[str, Any]] | None = None
    ) -> None:
        """Start the outputs; `rows` are the rounds a resumed run already has."""
        self.out_dir = out_dir
        self.cfg = cfg
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        self.path = out_dir / "metrics.jsonl"
        self.rows = list(rows or [])
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))
        self.wandb: Any = None
        if cfg.logger.name == "wandb":
            self.wandb = self._start_wandb()

    def _start_wandb(self) -> Any:
        import wandb

        settings = self.cfg.logger
        make_dir(self.out_dir / "wandb")  # where W&B writes: a folder here, never a link out
        run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            mode=settings.mode,
            dir=str(self.out_dir),
            config=plain(self.cfg),
            reinit="finish_previous",
        )
        for row in self.rows:
            run.log(row, step=row["round"])
        return run

    def append(self, row: dict[str, Any]) -> None:
        """Record one round."""
        row = {k: _jsonable(v) for k, v in row.items()}
        self.rows.append(row)
        with open_for_append(self.path) as f:
            f.write((json.dumps(row) + "\n").encode())
        if self.wandb is not None:
            self.wandb.log(row, step=row["round"])

    def finish(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write summary.json (with `extra` keys, e.g. ε per client) and the plot; close W&B."""
        target, window = self.cfg.get("target_accuracy"), int(self.cfg.get("target_window", 1))
        summary = {**summarize(self.rows, target, window), **(extra or {})}
        summary["evaluated_on"] = self.cfg.get("evaluate_on", "test")  # accuracy's split
        from fl.common.seeding import machine  # torch: this module's checks run before it

        summary["machine"] = machine()  # the last bits of a long run depend on it
        write_atomic(self.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        if self.rows and self.cfg.get("plots", True):
            from fl.run.plots import plot_run  # matplotlib (~1 CPU s): only when plotting

            plot_run(
                evaluated(self.rows), self.out_dir / "accuracy.png", title=self.cfg.strategy.name
            )
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()
        return summary


def check_logger(cfg: DictConfig) -> None:
    """`logger.name`: jsonl alone, or W&B beside it."""
    check_choice(cfg, "logger.name", LOGGERS)
