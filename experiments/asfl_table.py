"""Table of an ASFL sweep (`fl-run experiment=asfl`, `asfl_room`, ...): the latency–accuracy
objective per arm, and each arm's objective paired by seed with a reference arm's.

For each seed, O = ρ·Acc_final − (1−ρ)·L / L_FedAvg, where L is the arm's virtual time for
the run's rounds and L_FedAvg that of synchronous FedAvg on the same seed (spec
algorithms_b.md §1.3; ρ = 0.5). Also: final accuracy, virtual time, time to the target
accuracy and its ratio to FedAvg's, and for ASFL arms the mean quota K and lag tolerance τ
over the first and the last quarter of the rounds (does the policy move?). With
`--reference ARM`, every other arm's O minus ARM's on the seeds both ran, with its 95 %
t-interval; `--json` writes those differences for `experiments/scoreboard.py --figures`
(metric `objective_delta`). Several sweeps read as one (more seeds run later); a seed an
arm ran twice is refused.

    python experiments/asfl_table.py experiments/out/asfl/SWEEP_DIR [...] [--rho 0.5] \
        [--reference safa --json FIGURES.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl.common.config import is_finite
from fl.common.files import write_atomic
from fl.run.compare import Run, find_runs, group_by_arm, load_run
from fl.run.intervals import interval

ARM_KEY = "+experiment/asfl_arm="
SYNC = "fedavg"  # the arm whose virtual time is L_FedAvg


def _arm_and_seed(run: Run) -> tuple[str, int]:
    """The run's arm (the asfl_arm preset, then any other override it ran with, such as
    `safa strategy.cfcfm=false`) and its seed."""
    arm = next((o[len(ARM_KEY) :] for o in run.overrides if o.startswith(ARM_KEY)), None)
    if arm is None:
        raise ValueError(f"run {run.name} names no {ARM_KEY}... override: not an ASFL sweep's")
    seed = next((int(o[5:]) for o in run.overrides if o.startswith("seed=")), 0)
    other = [o for o in run.overrides if not o.startswith((ARM_KEY, "seed="))]
    return " ".join([arm, *other]), seed


def arm_runs(sweeps: Sequence[Path]) -> dict[str, dict[int, Run]]:
    """arm -> seed -> run over every finished run of `sweeps`; a seed an arm ran twice (a
    sweep given twice, two sweeps of one seed) is refused (`fl.run.compare.group_by_arm`)."""
    runs = (load_run(d) for sweep in sweeps for d in find_runs(sweep))
    return group_by_arm((*_arm_and_seed(run), run) for run in runs)


def _checked(run: Run) -> tuple[float, float]:
    """A run's final accuracy and virtual time, refused unless they are what they must be
    (a summary is a file's contents)."""
    acc, time = run.summary.get("final_accuracy"), run.summary.get("virtual_time_s")
    ok = all(is_finite(v) for v in (acc, time))
    if not (ok and 0.0 <= acc <= 1.0 and time > 0.0):
        raise ValueError(f"run {run.name}: final_accuracy {acc!r} or virtual_time_s {time!r}")
    return float(acc), float(time)


def objectives(runs: dict[str, dict[int, Run]], rho: float) -> dict[str, dict[int, float]]:
    """arm -> seed -> O, L_FedAvg taken from the sync arm's run on the same seed."""
    if SYNC not in runs:
        raise ValueError(f"no {SYNC!r} arm: O needs its virtual time (arms: {sorted(runs)})")
    sync_time = {seed: _checked(run)[1] for seed, run in runs[SYNC].items()}
    out: dict[str, dict[int, float]] = {}
    for arm, seeds in runs.items():
        missing = sorted(set(seeds) - set(sync_time))
        if missing:
            raise ValueError(f"arm {arm!r}: seeds {missing} have no {SYNC!r} run to pair with")
        out[arm] = {}
        for seed, run in seeds.items():
            acc, time = _checked(run)
            out[arm][seed] = rho * acc - (1 - rho) * time / sync_time[seed]
    return out


def paired(o: dict[str, dict[int, float]], reference: str) -> dict[str, Any]:
    """Every other arm's O minus `reference`'s on the seeds both ran, with the interval."""
    if reference not in o:
        raise ValueError(f"no arm {reference!r} (arms: {sorted(o)})")
    arms = {}
    for arm, values in o.items():
        seeds = sorted(set(values) & set(o[reference]))
        if arm == reference or not seeds:
            continue
        deltas = [values[s] - o[reference][s] for s in seeds]
        mean, lo, hi = interval(deltas)
        arms[arm] = {
            "reference": reference,
            "seeds": seeds,
            "objective_deltas": deltas,
            "mean": mean,
            "lo": lo,
            "hi": hi,
        }
    return {"reference": reference, "arms": arms}


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


def table(runs: dict[str, dict[int, Run]], rho: float) -> str:
    """The Markdown table of every arm, its seeds' mean ± sample std."""
    o = objectives(runs, rho)
    lines = [
        f"| arm | objective O (ρ={rho}) | final accuracy | virtual time (s) "
        "| time to target (s) | ÷ FedAvg's | policy (first → last quarter, per seed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, seeds in runs.items():
        cols: dict[str, list[float]] = defaultdict(list)
        drift = []
        for seed, run in sorted(seeds.items()):
            s, ref = run.summary, runs[SYNC][seed].summary
            cols["acc"].append(s["final_accuracy"])
            cols["time"].append(s["virtual_time_s"])
            ttt, ref_ttt = s.get("time_to_target_s"), ref.get("time_to_target_s")
            cols["ttt"].append(math.nan if ttt is None else ttt)
            cols["ttt_ratio"].append(math.nan if ttt is None or not ref_ttt else ttt / ref_ttt)
            if "quota_k" in run.rows[0]:
                drift.append(_policy_drift(run.rows))
        objective = [o[arm][seed] for seed in sorted(seeds)]
        lines.append(
            f"| {arm} | {_cell(objective)} | {_cell(cols['acc'])} "
            f"| {_cell(cols['time'], 1)} | {_cell(cols['ttt'], 1)} | {_cell(cols['ttt_ratio'], 2)} "
            f"| {'; '.join(drift) or '—'} |"
        )
    return "\n".join(lines)


def paired_table(figures: dict[str, Any]) -> str:
    """Each arm's O minus the reference's, paired by seed, its 95 % t-interval."""
    ref = figures["reference"]
    lines = [
        f"| arm − {ref} | seeds | O difference: mean [95 % t] | per seed |",
        "|---|---|---|---|",
    ]
    for arm, f in figures["arms"].items():
        each = " / ".join(f"{d:+.3f}" for d in f["objective_deltas"])
        seeds = ",".join(map(str, f["seeds"]))
        cell = f"{f['mean']:+.3f} [{f['lo']:+.3f}, {f['hi']:+.3f}]"
        lines.append(f"| {arm} − {ref} | {seeds} | {cell} | {each} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", type=Path, nargs="+")
    parser.add_argument("--rho", type=float, default=0.5)
    parser.add_argument("--reference", help="pair every other arm's O with this arm's")
    parser.add_argument("--json", type=Path, help="write the paired figures (needs --reference)")
    args = parser.parse_args(argv)
    if args.json and not args.reference:
        parser.error("--json needs --reference")
    if not 0.0 <= args.rho <= 1.0:
        parser.error(f"--rho {args.rho}: a preference lies in [0, 1]")
    try:
        runs = arm_runs(args.sweeps)
        print(table(runs, args.rho))
        if args.reference:
            figures = {"rho": args.rho, **paired(objectives(runs, args.rho), args.reference)}
            print()
            print(paired_table(figures))
            if args.json:
                write_atomic(args.json, json.dumps(figures, indent=2) + "\n")
    except (OSError, ValueError) as err:
        print(f"asfl_table: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
