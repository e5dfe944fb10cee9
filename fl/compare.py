"""Side-by-side comparison of runs: a Markdown table and plots from their metrics.jsonl.

Used by the experiment presets (`fl-run experiment=apf_vs_fedavg`): a Hydra multirun
whose `ComparisonCallback` writes `comparison.md`, `comparison.png` and, where the
runs report them, plots of strategy diagnostics, into the sweep directory.
Also callable on any run directories: `python -m fl.compare DIR [DIR ...]`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from fl.plots import plot_diagnostic, plot_runs

__all__ = ["ComparisonCallback", "compare_runs", "load_run"]

DIAGNOSTICS = ("frozen_fraction", "local_steps", "consistency", "mean_period", "epsilon_max")


def load_run(run_dir: Path) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(label, rows, summary) of a finished run; the label is its sweep overrides."""
    overrides = run_dir / ".hydra" / "overrides.yaml"
    names = yaml.safe_load(overrides.read_text()) if overrides.exists() else []
    label = " ".join(o for o in names if not o.startswith("experiment=")) or run_dir.name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return label, rows, summary


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _table(runs: list[tuple[str, list[dict[str, Any]], dict[str, Any]]]) -> str:
    """Markdown table; traffic relative to the first run (the reference arm)."""
    ref = runs[0][2]
    ref_total = ref["total_bytes_up"] + ref["total_bytes_down"]
    ref_payload = ref["total_payload_bytes_up"] + ref["total_payload_bytes_down"]
    present = [k for k in DIAGNOSTICS if any(_mean(rows, k) is not None for _, rows, _ in runs)]
    target = ref.get("target_accuracy")
    to_target = [f"rounds to {target}", f"MB to {target}"] if target is not None else []
    head = [
        "run",
        "final acc",
        "best acc",
        "traffic MB (as sent)",
        "vs ref",
        "traffic MB (payload only)",
        "vs ref",
        "virtual time s",
        *to_target,
        *[f"mean {k}" for k in present],
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rows, s in runs:
        total = s["total_bytes_up"] + s["total_bytes_down"]
        payload = s["total_payload_bytes_up"] + s["total_payload_bytes_down"]
        cells = [
            label,
            f"{s['final_accuracy']:.4f}",
            f"{s['best_accuracy']:.4f}",
            f"{total / 1e6:.1f}",
            f"{total / ref_total:.1%}",
            f"{payload / 1e6:.1f}",
            f"{payload / ref_payload:.1%}",
            f"{s['virtual_time_s']:.1f}",
        ]
        if to_target:
            hit = s.get("bytes_to_target")
            cells += [str(s.get("rounds_to_target")), f"{hit / 1e6:.1f}" if hit else "not reached"]
        cells += [f"{_mean(rows, k):.3f}" if _mean(rows, k) is not None else "-" for k in present]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare_runs(run_dirs: Sequence[Path], out_dir: Path, title: str = "") -> str:
    """Write comparison.md and plots for `run_dirs` into `out_dir`; return the table."""
    runs = [load_run(d) for d in run_dirs]
    table = _table(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "comparison.md").write_text(f"# {title}\n\n{table}" if title else table)
    plot_runs({label: rows for label, rows, _ in runs}, out_dir / "comparison.png", title=title)
    for key in DIAGNOSTICS:
        series = {label: rows for label, rows, _ in runs if _mean(rows, key) is not None}
        if series:
            plot_diagnostic(series, key, out_dir / f"{key}.png", title=title)
    return table


class ComparisonCallback(Callback):
    """Hydra callback: compare every job of a multirun once the sweep ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        run_dirs = sorted(
            (p.parent for p in sweep_dir.glob("*/summary.json")),
            key=lambda p: int(p.name) if p.name.isdigit() else p.name,
        )
        if run_dirs:
            title = str(config.get("experiment_title") or sweep_dir.name)
            print(compare_runs(run_dirs, sweep_dir, title))
            print(f"comparison written to {sweep_dir}/comparison.md and comparison.png")


if __name__ == "__main__":
    dirs = [Path(a) for a in sys.argv[1:]]
    print(compare_runs(dirs, Path.cwd(), "comparison"))
