"""FedCA's own figures from a finished `fl-run experiment=fedca` sweep (spec §6.9).

Writes into the output directory: `fedca_table.md` (per arm: virtual time to the target
accuracy, rounds to it, mean round time, final accuracy and the mean of the last 10
rounds, traffic) and `fedca_cdf.png` (CDFs of the iteration each client stopped at and
of the iteration each eager layer left at, over all tuned replies of a run: the paper's
Fig. 8). Everything comes from the per-round metrics the strategy logs.

    python -m experiments.fedca_cdf experiments/out/fedca/<sweep> [more sweeps] --out DIR
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl.common.files import write_atomic
from fl.run.compare import Run, find_runs, load_run

__all__ = ["arm_table", "main", "plot_cdfs"]


def _label(run: Run) -> str:
    strategy = [o.split("=", 1)[1] for o in run.overrides if o.startswith("strategy=")]
    return strategy[0] if strategy else run.name


def _values(rows: Sequence[dict[str, Any]], key: str) -> list[int]:
    return [v for r in rows for v in r.get(key) or []]


def arm_table(runs: Sequence[Run]) -> str:
    """One line per run; time to target relative to the first run (FedAvg)."""
    ref = runs[0].summary.get("time_to_target_s")
    target = runs[0].summary.get("target_accuracy")
    head = [
        "arm",
        f"virtual s to {target}",
        "vs first",
        f"rounds to {target}",
        "mean round s",
        "rounds run",
        "final acc",
        "mean acc, last 10",
        "MB up+down",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        s, rows = run.summary, run.rows
        hit = s.get("time_to_target_s")
        last = [r["accuracy"] for r in rows[-10:]]
        cells = [
            _label(run),
            f"{hit:.2f}" if hit is not None else "not reached",
            "not reached" if hit is None else f"{hit / ref:.2f}" if ref else "-",
            "not reached" if s.get("rounds_to_target") is None else str(s["rounds_to_target"]),
            f"{sum(r['round_time_s'] for r in rows) / len(rows):.4f}",
            str(len(rows)),
            f"{s['final_accuracy']:.4f}",
            f"{sum(last) / len(last):.4f}",
            f"{(s['total_bytes_up'] + s['total_bytes_down']) / 1e6:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_cdfs(runs: Sequence[Run], path: Path) -> None:
    """CDFs of stop iterations and eager-send iterations, one line per FedCA arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, key, title in (
        (axes[0], "stop_steps", "iteration a client stopped at"),
        (axes[1], "eager_steps", "iteration an eager layer left at"),
    ):
        for run in runs:
            values = sorted(_values(run.rows, key))
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, fractions, where="post", label=_label(run))
        ax.set_xlabel(title)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Table and CDFs for the runs of the given sweep (or run) directories."""
    parser = argparse.ArgumentParser(prog="python -m experiments.fedca_cdf")
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR")
    parser.add_argument("--out", type=Path, help="output directory (default: the first DIR)")
    args = parser.parse_args(argv)
    runs = [load_run(d) for path in args.dirs for d in find_runs(path)]
    if not runs:
        print("experiments.fedca_cdf: no finished runs found", file=sys.stderr)
        return 2
    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    table = arm_table(runs)
    write_atomic(out / "fedca_table.md", table)
    plot_cdfs(runs, out / "fedca_cdf.png")
    print(table)
    print(f"written to {out / 'fedca_table.md'} and {out / 'fedca_cdf.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
