"""Time-to-accuracy table of an `fl-run experiment=r2sp` sweep, in virtual seconds.

The sweep's own comparison.md counts rounds to the target; R2SP's claim is about time,
and its rounds (one group each) are not BSP's (every client), so this table reads
each arm's metrics.jsonl for the virtual time at which it first reached 0.90 and 0.94,
relative to the first arm (BSP), and its mean time per cycle (every group once). Runs are
read as `fl.run.compare` reads them (finished jobs only, regular files, kept archives).

    python experiments/r2sp_table.py experiments/out/r2sp/<stamp>

With `--relative F` (the room workload's rule, issue 35: its accuracies are not the digits
task's, so 0.90 means nothing there), each seed's target is F × BSP's final accuracy (the
trailing `--window`-round mean at the end of BSP's run, `loop.groups=1 strategy=fedavg`,
same seed), an arm reaches it when its trailing mean does, and each arm's time is paired
with BSP's seed by seed: mean [95 % t-interval] over the seeds where both reached it.
Chosen on 2026-12-04 before the r2sp_room sweep's grouped arms had finished.

    python experiments/r2sp_table.py experiments/out/r2sp_room/<stamp> --relative 0.9
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fl.run.compare import Run, find_runs, group_by_arm, load_run
from fl.run.intervals import interval
from fl.run.tracking import evaluated

TARGETS = (0.90, 0.94)
BSP = "loop.groups=1 strategy=fedavg"


def _groups(run: Run) -> int:
    """The run's `loop.groups` (1, BSP's, where its overrides do not set it)."""
    return next((int(o.split("=")[1]) for o in run.overrides if o.startswith("loop.groups=")), 1)


def _seed_arm(run: Run) -> tuple[str, str, Run]:
    """(arm, seed, run): the arm is the run's overrides but its seed."""
    seed = next((o for o in run.overrides if o.startswith("seed=")), "seed=0")
    arm = " ".join(o for o in run.overrides if not o.startswith("seed="))
    return arm, seed, run


def _time_to(rows: list[dict[str, Any]], target: float) -> float | None:
    return next((r["virtual_time_s"] for r in evaluated(rows) if r["accuracy"] >= target), None)


def table(sweep: Path) -> str:
    """The Markdown table of the sweep's finished jobs, first job as the reference."""
    runs = [load_run(job) for job in find_runs(sweep)]
    arms = [(" ".join(run.overrides), _groups(run), run.rows) for run in runs]
    ref = [_time_to(arms[0][2], t) for t in TARGETS]
    head = ["arm"]
    for t in TARGETS:
        head += [f"time to {t:.2f} (s)", "vs BSP"]
    head += ["s per cycle", "rounds", "final acc", "best acc", "max staleness"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, groups, rows in arms:
        cells = [label]
        for t, base in zip(TARGETS, ref, strict=True):
            reached = _time_to(rows, t)
            cells += ["—", "—"] if reached is None else [f"{reached:.1f}", ""]
            if reached is not None and base is not None:
                cells[-1] = f"{reached / base:.2f}"
        cycle = rows[-1]["virtual_time_s"] * groups / len(rows)
        staleness = max(r.get("staleness_max", 0) for r in rows)
        best = max(r["accuracy"] for r in evaluated(rows))
        acc = rows[-1]["accuracy"]  # the last round is always evaluated
        cells += [f"{cycle:.2f}", str(len(rows)), f"{acc:.3f}", f"{best:.3f}", str(staleness)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _trailing(rows: list[dict[str, Any]], window: int) -> list[tuple[float, float]]:
    """(virtual time, mean accuracy of the last `window` evaluated rounds) at each evaluated
    round from the `window`-th on (every round, unless the run set `evaluate_every` > 1)."""
    rows = evaluated(rows)
    acc = [r["accuracy"] for r in rows]
    return [
        (rows[i]["virtual_time_s"], sum(acc[i + 1 - window : i + 1]) / window)
        for i in range(window - 1, len(rows))
    ]


def relative_table(sweep: Path, fraction: float, window: int) -> str:
    """Each arm's virtual time to `fraction` × BSP's final trailing accuracy, per seed and
    paired with BSP's (the docstring's rule)."""
    by_arm = group_by_arm(_seed_arm(load_run(job)) for job in find_runs(sweep))
    curves = {  # each run's (virtual time, trailing accuracy), computed once
        arm: {seed: _trailing(run.rows, window) for seed, run in seeds.items()}
        for arm, seeds in by_arm.items()
    }
    targets = {seed: fraction * curve[-1][1] for seed, curve in curves[BSP].items()}

    def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
        return next((t for t, acc in curve if acc >= target), None)

    head = ["arm", "seeds", "reached", "time to target × BSP, mean [95 % t-interval]", "per seed"]
    head += ["final acc (trailing)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, seeds in curves.items():
        ratios, shown = [], []
        for seed, curve in sorted(seeds.items()):
            if seed not in targets:
                continue
            mine, base = time_to(curve, targets[seed]), time_to(curves[BSP][seed], targets[seed])
            shown.append("—" if mine is None or not base else f"{mine / base:.2f}")
            if mine is not None and base:
                ratios.append(mine / base)
        if len(ratios) >= 2:
            mean, lo, hi = interval(ratios)
            figure = f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"
        else:
            figure = "—"
        finals = [curve[-1][1] for curve in seeds.values()]
        final = f"{sum(finals) / len(finals):.3f}"
        row = [arm, str(len(seeds)), str(len(ratios)), figure, ", ".join(shown), final]
        lines.append("| " + " | ".join(row) + " |")
    shown_targets = ", ".join(f"{s}: {t:.3f}" for s, t in sorted(targets.items()))
    return f"targets ({fraction} × BSP's final trailing accuracy): {shown_targets}\n\n" + "\n".join(
        lines
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="the sweep directory of fl-run experiment=r2sp")
    parser.add_argument("--relative", type=float, help="target: this fraction of BSP's final")
    parser.add_argument("--window", type=int, default=5, help="trailing rounds (--relative)")
    args = parser.parse_args()
    if args.relative is None:
        print(table(args.sweep))
    else:
        print(relative_table(args.sweep, args.relative, args.window))


if __name__ == "__main__":
    main()
