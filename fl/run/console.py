"""What a person watching a run sees: a per-round table, a progress bar, a final line.

On a terminal the table scrolls above a progress bar; without one (CI, `| tee`, a
file) only the plain table lines are written, so the log holds no redraw frames.
Flower's log lines go through Hydra's handlers, once each (`flower_logs_once`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

__all__ = ["RoundReporter", "flower_logs_once", "human_bytes", "human_seconds"]


def human_bytes(n: float) -> str:
    """Bytes in SI units (kB = 1,000 bytes, as the comparison tables' MB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    """Seconds with two decimals below 10 s, one above."""
    return f"{s:.2f} s" if abs(s) < 10 else f"{s:.1f} s"


def _fixed(digits: int) -> Callable[[Any], str]:
    return lambda v: f"{v:.{digits}f}"


def _epsilon(v: Any) -> str:
    return "-" if v is None else f"{v:.3g}"


Column = tuple[str, str, Callable[[Any], str], int]  # header, row key, cell format, width

COLUMNS: tuple[Column, ...] = (
    ("round", "round", str, 5),
    ("accuracy", "accuracy", _fixed(4), 8),
    ("loss", "loss", _fixed(4), 7),
    ("up", "bytes_up", human_bytes, 9),
    ("down", "bytes_down", human_bytes, 9),
    ("round time", "round_time_s", human_seconds, 10),
    ("virtual time", "virtual_time_s", human_seconds, 12),
    ("failed", "failed", str, 6),
    ("missing", "missing", str, 7),
    ("rejected", "rejected", str, 8),
)
EPSILON: Column = ("ε max", "epsilon_max", _epsilon, 6)  # only when privacy reports it


class RoundReporter:
    """The per-round table (and, on a terminal, a progress bar); silent unless `enabled`."""

    def __init__(
        self,
        total: int,
        initial: int,
        desc: str,
        *,
        enabled: bool,
        stream: TextIO | None = None,
        arrival: str = "virtual",
    ) -> None:
        """`arrival`: the run's `loop.arrival`; with `real` arrivals the clock is the wall
        clock since training began, and its column and the final line say "wall time"."""
        self.enabled = enabled
        self.clock = "wall" if arrival == "real" else "virtual"
        self.stream = stream if stream is not None else sys.stdout
        self._columns: tuple[Column, ...] = ()
        self._bar: tqdm[Any] | None = None
        self._logs = contextlib.ExitStack()
        if enabled and self.stream.isatty():
            self._bar = tqdm(total=total, initial=initial, desc=desc)
            # Log lines written while the bar is drawn would land on the bar's line.
            self._logs.enter_context(logging_redirect_tqdm())

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def round_done(self, row: dict[str, Any]) -> None:
        """Print one round's line of the table (the header before the first)."""
        if not self.enabled:
            return
        if not self._columns:
            columns = tuple(_clock_column(c, self.clock) for c in COLUMNS)
            self._columns = (*columns, EPSILON) if "epsilon_max" in row else columns
            self._write(" ".join(f"{h:>{w}}" for h, _, _, w in self._columns))
        cells = [f"{fmt(row[key]) if key in row else '-':>{w}}" for _, key, fmt, w in self._columns]
        self._write(" ".join(cells))
        if self._bar is not None:
            if "accuracy" in row:  # not on the rounds between evaluations
                self._bar.set_postfix(acc=f"{row['accuracy']:.3f}")
            self._bar.update()

    def close(self, summary: dict[str, Any], out_dir: Path) -> None:
        """Close the bar and print the final line: accuracy, totals, time to target."""
        if self._bar is not None:
            self._bar.close()
        self._logs.close()
        if self.enabled and "final_accuracy" in summary:
            print(_final_line(summary, out_dir, self.clock), file=self.stream, flush=True)


def _clock_column(column: Column, clock: str) -> Column:
    """The `virtual time` column renamed after the clock that fills it (`wall time`)."""
    _, key, fmt, width = column
    return (f"{clock} time", key, fmt, width) if key == "virtual_time_s" else column


def _final_line(summary: dict[str, Any], out_dir: Path, clock: str = "virtual") -> str:
    """One line that says how the run ended, and where its outputs are."""
    parts = [
        f"final accuracy {summary['final_accuracy']:.4f} "
        f"(best {summary['best_accuracy']:.4f}) after {summary['rounds']} rounds",
        f"{human_seconds(summary['virtual_time_s'])} {clock} time",
        f"{human_bytes(summary['total_bytes_up'])} up, "
        f"{human_bytes(summary['total_bytes_down'])} down",
    ]
    target = summary.get("target_accuracy")
    if target is not None:
        rounds = summary.get("rounds_to_target")
        if rounds is None:
            parts.append(f"target {target} not reached")
        else:
            seconds = human_seconds(summary["time_to_target_s"])
            parts.append(f"target {target} reached in round {rounds} at {seconds}")
    if summary.get("epsilon_max") is not None:
        parts.append(f"ε max {summary['epsilon_max']:.3g}")
    return "; ".join(parts) + f"; outputs in {out_dir}"


def flower_logs_once() -> None:
    """Flower's log lines once each, through Hydra's handlers, at Hydra's `flwr` level.

    Importing flwr gives its `flwr` logger a console handler of its own and sets the
    logger to DEBUG. Under Hydra, whose root handlers (console and run.log) already get
    every propagated line, that printed each line twice and let DEBUG lines through,
    ignoring `hydra.job_logging.loggers.flwr.level`. Without root handlers (a process
    Hydra did not start) Flower's console is the only one, and is left alone.
    """
    from flwr.supercore.logger import console_handler  # importing it adds the handler
    from hydra.core.hydra_config import HydraConfig

    if not logging.getLogger().handlers:
        return
    flower = logging.getLogger("flwr")
    flower.removeHandler(console_handler)
    level = "INFO"  # Flower's own console default
    if HydraConfig.initialized():
        loggers = HydraConfig.get().job_logging.get("loggers") or {}
        level = (loggers.get("flwr") or {}).get("level", level)
    flower.setLevel(level)
