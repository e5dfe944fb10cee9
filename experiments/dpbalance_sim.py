"""DPBalance vs DPF, DPK and FCFS on the paper's §VI workload shape, over seeds and variants.

    .venv/bin/python experiments/dpbalance_sim.py [--seeds 0 1 2] [--out experiments/out/dpbalance]

Variants: the paper's setup; DPF unlocking faster (N = 10 instead of PrivateKube's 100);
scarce budgets (device ε ~ U(0.2, 0.3)); DPBalance with κ capped at 1.25. Writes
`summary.md` (gains, mean and 95 % t-interval over seeds), `results.json`, and one figure per
variant (seed 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl.common.files import write_atomic
from fl.run.intervals import interval
from privacy.cli import plot
from privacy.simulation import Workload, compare

VARIANTS: dict[str, dict[str, Any]] = {
    "paper": {},
    "dpf_n10": {"dpf_n": 10},
    "scarce": {"budget": (0.2, 0.3)},
    "kappa_cap": {"kappa_max": 1.25},
}
BASELINES = ("dpf", "dpk", "fcfs")


def _span(values: list[float]) -> str:
    """Mean [95 % t-interval over seeds] (issue 29: a verdict carries its interval)."""
    mean, low, high = interval(values)
    return f"{mean:.2f} [{low:.2f}, {high:.2f}]"


def summary_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Per variant and β: DPBalance's gains and every scheduler's Jain index, over seeds."""
    lines = [
        "| variant | β | eff. gain vs DPF | vs DPK | vs FCFS | f_β gain vs DPF | vs DPK | vs FCFS "
        "| Jain DPBalance | DPF | DPK | FCFS | served DPBalance / FCFS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, runs in results.items():
        for i, row0 in enumerate(runs[0]["table"]):
            rows = [run["table"][i] for run in runs]
            cells = [variant, str(row0["beta"])]
            cells += [_span([r[f"efficiency_gain_vs_{b}"] for r in rows]) for b in BASELINES]
            cells += [_span([r[f"fairness_gain_vs_{b}"] for r in rows]) for b in BASELINES]
            cells += [
                f"{statistics.mean(r[s]['jain'] for r in rows):.2f}"
                for s in ("dpbalance", *BASELINES)
            ]
            served = [(r["dpbalance"]["served"], r["fcfs"]["served"]) for r in rows]
            cells.append(" ".join(f"{a}/{b}" for a, b in served))
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| variant | β sweep of DPBalance: efficiency Σ U / Jain (mean over seeds) |"]
    lines += ["|---|---|"]
    for variant, runs in results.items():
        sweep = []
        for j, point in enumerate(runs[0]["trade_off"]):
            eff = statistics.mean(run["trade_off"][j]["efficiency"] for run in runs)
            jain = statistics.mean(run["trade_off"][j]["jain"] for run in runs)
            sweep.append(f"β={point['beta']}: {eff:.2f} / {jain:.2f}")
        lines.append(f"| {variant} | " + "; ".join(sweep) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run every variant for every seed; write the summary, raw results and figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="experiments/out/dpbalance")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    for variant, options in VARIANTS.items():
        results[variant] = []
        for seed in args.seeds:
            workload = Workload(seed=seed, budget=options.get("budget", (1.0, 1.5)))
            result = compare(
                workload,
                dpf_n=options.get("dpf_n", 100),
                kappa_max=options.get("kappa_max"),
            )
            results[variant].append(result)
            print(f"{variant} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
        plot(results[variant][0], out / f"{variant}.png")
    table = summary_table(results)
    write_atomic(out / "summary.md", table)
    write_atomic(out / "results.json", json.dumps(results, indent=1) + "\n")
    print(table)
    print(f"wrote {out}/summary.md, results.json and one figure per variant")


if __name__ == "__main__":
    main()
