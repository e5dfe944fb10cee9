"""Table of `fl-run experiment=asfl`: the latency–accuracy objective per arm, seeds averaged.

For each seed, O = ρ·Acc_final − (1−ρ)·L / L_FedAvg, where L is the arm's virtual time for
the run's rounds and L_FedAvg that of synchronous FedAvg on the same seed (spec
algorithms_b.md §1.3; ρ = 0.5). Also: final accuracy, virtual time, time to the target
accuracy and its ratio to FedAvg's, and for ASFL arms the mean quota K and lag tolerance τ
over the first and the last quarter of the rounds (does the policy move?).

    python experiments/asfl_table.py experiments/out/asfl/SWEEP_DIR [--rho 0.5]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from fl.run.compare import Run, find_runs, load_run

ARM_KEY = "+experiment/asfl_arm="


def _arm_and_seed(run: Run) -> tuple[str, int]:
    arm = next(o[len(ARM_KEY) :] for o in run.overrides if o.startswith(ARM_KEY))
    seed = next((int(o[5:]) for o in run.overrides if o.startswith("seed=")), 0)
    return arm, seed


def _cell(values: list[float], digits: int = 3) -> str:
    if any(v != v for v in values):  # NaN: some seed never got there
        return "not reached in " + str(sum(v != v for v in values)) + " seed(s)"
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"


def _policy_drift(rows: list[dict[str, Any]]) -> str:
    quarter = max(1, len(rows) // 4)
    first, last = rows[:quarter], rows[-quarter:]

    def mean(part: list[dict[str, Any]], key: str) -> float:
        return statistics.fmean(r[key] for r in part)

    return (
        f"K {mean(first, 'quota_k'):.1f}→{mean(last, 'quota_k'):.1f}, "
        f"τ {mean(first, 'lag_tolerance'):.1f}→{mean(last, 'lag_tolerance'):.1f}"
    )


def table(sweep: Path, rho: float) -> str:
    """The Markdown table for one sweep directory."""
    runs = {_arm_and_seed(r): r for r in map(load_run, find_runs(sweep))}
    arms: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    drift: dict[str, list[str]] = defaultdict(list)
    for (arm, seed), run in sorted(runs.items()):
        ref = runs[("fedavg", seed)].summary
        s = run.summary
        cols = arms[arm]
        cols["acc"].append(s["final_accuracy"])
        cols["time"].append(s["virtual_time_s"])
        cols["objective"].append(
            rho * s["final_accuracy"] - (1 - rho) * s["virtual_time_s"] / ref["virtual_time_s"]
        )
        nan = float("nan")
        ttt, ref_ttt = s.get("time_to_target_s"), ref.get("time_to_target_s")
        cols["ttt"].append(nan if ttt is None else ttt)
        cols["ttt_ratio"].append(nan if ttt is None or not ref_ttt else ttt / ref_ttt)
        if "quota_k" in run.rows[0]:
            drift[arm].append(_policy_drift(run.rows))
    lines = [
        f"| arm | objective O (ρ={rho}) | final accuracy | virtual time (s) "
        "| time to target (s) | ÷ FedAvg's | policy (first → last quarter, per seed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, cols in arms.items():
        lines.append(
            f"| {arm} | {_cell(cols['objective'])} | {_cell(cols['acc'])} "
            f"| {_cell(cols['time'], 1)} | {_cell(cols['ttt'], 1)} | {_cell(cols['ttt_ratio'], 2)} "
            f"| {'; '.join(drift[arm]) or '—'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--rho", type=float, default=0.5)
    args = parser.parse_args()
    print(table(args.sweep, args.rho))


if __name__ == "__main__":
    main()
