"""Each arm of a room sweep against a reference arm, seed by seed (issue 35).

An arm's figure on a seed is its mean test accuracy over its last `--window` rounds. With
`--equal-time` (GIFT, PAS: claims at equal time, and their rounds shorten as the period
falls) those rounds are the last that end by T, the earliest final virtual time of the
seed's runs; without it, the last rounds of each run (equal rounds: 2D-LRD's claim).
Δ = arm − reference in points, paired by seed: the mean and its 95 % t-interval, the seeds'
values, and the verdict against `--bar` (Δ ≥ bar: reproduces when the interval lies above,
does not when it lies below, inconclusive when it holds the bar). The rules were fixed in
each preset's header before its results were read.

    python experiments/room_table.py experiments/out/gift_room/<stamp> \
        --reference strategy=fedavg --equal-time --window 10
    python experiments/room_table.py experiments/out/lrd2d_room/<stamp> [more sweeps] \
        --reference strategy.axes=both --window 20 --json OUT

Runs are read as data (`fl.run.compare.load_run`: regular files only); every accuracy and
virtual time is checked before it is used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl.common.files import write_atomic
from fl.run.compare import Run, find_runs, seed_arms
from fl.run.intervals import interval

POINTS = (-100.0, 100.0)  # a difference of two accuracies, in points


def _series(run: Run) -> tuple[list[float], list[float]]:
    """A run's (virtual end time, test accuracy) per round, checked."""
    times, accuracies = [], []
    for row in run.rows:
        t, a = row.get("virtual_time_s"), row.get("accuracy")
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in (t, a)):
            raise ValueError(
                f"run {run.name}: round {row.get('round')} has no finite time/accuracy"
            )
        if not 0.0 <= a <= 1.0 or (times and t < times[-1]):
            raise ValueError(f"run {run.name}: round {row.get('round')} is out of range or order")
        times.append(float(t))
        accuracies.append(float(a))
    if not times:
        raise ValueError(f"run {run.name} has no rounds")
    return times, accuracies


def _figure(run: Run, window: int, by: float) -> float:
    """Mean accuracy of the run's last `window` rounds ending by virtual time `by`."""
    times, accuracies = _series(run)
    kept = [a for t, a in zip(times, accuracies, strict=True) if t <= by]
    if len(kept) < window:
        raise ValueError(f"run {run.name}: {len(kept)} rounds end by {by:.1f} s, need {window}")
    return sum(kept[-window:]) / window


def _seed(run: Run) -> str:
    seed = next((o.partition("=")[2] for o in run.overrides if o.startswith("seed=")), None)
    if seed is None or not seed.isdigit():
        raise ValueError(f"run {run.name} names no seed (seed={seed!r})")
    return seed


def paired(
    arms: dict[str, list[Run]], reference: str, window: int, equal_time: bool
) -> dict[str, Any]:
    """Per arm, Δ accuracy vs `reference` in points on each seed both ran, and each seed's T."""
    if reference not in arms:
        raise ValueError(f"no arm {reference!r}; arms: {sorted(arms)}")
    by_seed: dict[str, dict[str, Run]] = {}
    for arm, runs in arms.items():
        for run in runs:
            by_seed.setdefault(_seed(run), {})[arm] = run
    ends = {
        seed: min(_series(r)[0][-1] for r in runs.values()) if equal_time else math.inf
        for seed, runs in by_seed.items()
    }
    out: dict[str, Any] = {"budget_s": ends if equal_time else None, "arms": {}}
    for arm in arms:
        if arm == reference:
            continue
        seeds = sorted(
            (s for s, runs in by_seed.items() if arm in runs and reference in runs), key=int
        )
        deltas = [
            100
            * (
                _figure(by_seed[s][arm], window, ends[s])
                - _figure(by_seed[s][reference], window, ends[s])
            )
            for s in seeds
        ]
        mean, lo, hi = interval(deltas, bounds=POINTS) if deltas else (math.nan,) * 3
        out["arms"][arm] = {"seeds": seeds, "deltas": deltas, "mean": mean, "lo": lo, "hi": hi}
    return out


def verdict(lo: float, hi: float, bar: float) -> str:
    """Against Δ ≥ bar: the interval above it, below it, or holding it."""
    if lo > bar:
        return "reproduces"
    if hi < bar:
        return "does not reproduce"
    return "inconclusive"


def table(result: dict[str, Any], reference: str, bar: float) -> str:
    """The figures as a Markdown table, a line per arm, and each seed's T where timed."""
    head = [f"arm − {reference} (points)", "seeds", "mean [95 % CI]", "per seed"]
    lines = ["| " + " | ".join([*head, f"verdict (Δ ≥ {bar:g})"]) + " |", "|---" * 5 + "|"]
    for arm, f in result["arms"].items():
        cells = [
            arm,
            ",".join(f["seeds"]),
            f"{f['mean']:+.2f} [{f['lo']:+.2f}, {f['hi']:+.2f}]",
            " / ".join(f"{d:+.2f}" for d in f["deltas"]),
            verdict(f["lo"], f["hi"], bar),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if result["budget_s"]:
        ends = ", ".join(f"seed {s}: {t:.1f}" for s, t in sorted(result["budget_s"].items()))
        lines.append(f"\nEqual virtual time T (s): {ends}.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--reference", required=True, help="the reference arm's overrides")
    parser.add_argument("--window", type=int, default=10, help="rounds averaged")
    parser.add_argument("--equal-time", action="store_true", help="at the seed's earliest end")
    parser.add_argument("--bar", type=float, default=0.0, help="the claim: Δ ≥ bar points")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error("--window must be at least 1")
    arms = seed_arms([job for sweep in args.sweeps for job in find_runs(sweep)])
    if not arms:
        parser.error("no arm ran several seeds in these sweeps")
    result = paired(arms, args.reference, args.window, args.equal_time)
    print(table(result, args.reference, args.bar), end="")
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
