"""What a person watching a run sees: a progress bar, a per-round table, a final line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = ["RoundReporter"]

COLUMNS = ("round", "accuracy", "loss", "bytes_up", "bytes_down", "virtual_time_s")


class RoundReporter:
    """Progress over rounds on the terminal; silent when `enabled` is false."""

    def __init__(self, total: int, initial: int, desc: str, *, enabled: bool) -> None:
        self.enabled = enabled
        self._header = True
        self._bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled)

    def round_done(self, row: dict[str, Any]) -> None:
        """Print one round's line of the table and advance the bar."""
        if self.enabled:
            if self._header:
                self._bar.write("  ".join(f"{c:>14}" for c in COLUMNS))
                self._header = False
            cells = [
                f"{row[c]:>14.4f}" if isinstance(row[c], float) else f"{row[c]:>14}"
                for c in COLUMNS
            ]
            self._bar.write("  ".join(cells))
        self._bar.set_postfix(acc=f"{row['accuracy']:.3f}")
        self._bar.update()

    def close(self, summary: dict[str, Any], out_dir: Path) -> None:
        """Close the bar and print the final line."""
        self._bar.close()
        if self.enabled and "final_accuracy" in summary:
            print(
                f"final accuracy {summary['final_accuracy']:.4f} after {summary['rounds']} "
                f"rounds; outputs in {out_dir}"
            )
