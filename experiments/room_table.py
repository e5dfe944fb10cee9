"""Each arm of a room sweep against a reference arm, seed by seed (issue 35).

An arm's figure on a seed is its mean test accuracy over its last `--window` rounds (its
last evaluated rounds, where a run set `evaluate_every` > 1). With
`--equal-time` (GIFT, PAS: claims at equal time, and their rounds shorten as the period
falls) those rounds are the last that end by T, the earliest final virtual time of the
seed's runs; without it, the last rounds of each run (equal rounds: 2D-LRD's claim).
Δ = arm − reference in points, paired by seed: the mean and its 95 % t-interval, the seeds'
values, and the verdict against `--bar` (Δ ≥ bar: reproduces when the interval lies above,
does not when it lies below, inconclusive when it holds the bar). `--pair ARM REF` pairs an
arm with its own reference instead (each metric graft with its original). `--bytes` adds
the bytes as sent by the same end, arm ÷ reference, against `--ratio-bar` (ratio < bar).

`--to-target N` (APF: bytes to convergence; FedCA with `--measure time`: virtual time to
it) reads a cost instead: the target is the reference's mean accuracy over its last N
rounds, averaged over seeds, minus `--margin` points; a run reaches it where its trailing
mean over `--reach-window` rounds (5, fl-run's `target_window`) first does, and its figure
is its bytes as sent (or virtual time) by then, arm ÷ reference paired by seed, against
`--ratio-bar`. An arm that misses the
target on a seed its reference reached cannot reproduce (inconclusive at best), and does
not when it misses on more than half its seeds. The rules were fixed in each preset's
header before its results were read.

    python experiments/room_table.py experiments/out/gift_room/<stamp> \
        --reference strategy=fedavg --equal-time --window 10
    python experiments/room_table.py experiments/out/lrd2d_room/<stamp> [more sweeps] \
        --reference strategy.axes=both --window 20 --json OUT
    python experiments/room_table.py experiments/out/grafting_room/<stamp> --window 10 \
        --pair strategy=graft_apf strategy=apf --bytes --bar -1
    python experiments/room_table.py experiments/out/apf_room/<stamp> \
        --reference strategy=fedavg --to-target 100 --margin 1 --ratio-bar 0.6
    python experiments/room_table.py experiments/out/fedca_room/<stamp> \
        --reference strategy=fedavg --to-target 50 --measure time --ratio-bar 0.85

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

from experiments.scoreboard import condition_verdict
from fl.common.config import is_finite
from fl.common.files import write_atomic
from fl.run.compare import Run, find_runs, seed_arms
from fl.run.intervals import interval
from fl.run.tracking import evaluated, reached_target

POINTS = (-100.0, 100.0)  # a difference of two accuracies, in points
RATIO = (0.0, math.inf)  # bytes ÷ bytes, time ÷ time
MEASURES = ("bytes", "time")  # what --to-target reads: bytes as sent, virtual time
Pairs = Sequence[tuple[str, str]]


def _series(run: Run) -> tuple[list[float], list[float], list[float]]:
    """A run's (virtual end time, test accuracy, bytes as sent so far) per round, checked;
    bytes are NaN where a run recorded none (only `--bytes` and `--to-target` read them)."""
    times: list[float] = []
    accuracies: list[float] = []
    sent: list[float] = []
    for row in evaluated(run.rows):  # with evaluate_every > 1, the evaluated rounds
        t, a = row.get("virtual_time_s"), row.get("accuracy")
        if not (is_finite(t) and is_finite(a)):
            raise ValueError(
                f"run {run.name}: round {row.get('round')} has no finite time/accuracy"
            )
        if not 0.0 <= a <= 1.0 or (times and t < times[-1]):
            raise ValueError(f"run {run.name}: round {row.get('round')} is out of range or order")
        up, down = row.get("cum_bytes_up"), row.get("cum_bytes_down")
        total = up + down if is_finite(up) and is_finite(down) else math.nan
        if not math.isnan(total) and (total < 0 or (sent and total < sent[-1])):
            raise ValueError(f"run {run.name}: round {row.get('round')}'s bytes go back")
        times.append(float(t))
        accuracies.append(float(a))
        sent.append(float(total))
    if not times:
        raise ValueError(f"run {run.name} has no rounds")
    return times, accuracies, sent


def _figure(run: Run, window: int, by: float) -> float:
    """Mean accuracy of the run's last `window` rounds ending by virtual time `by`."""
    times, accuracies, _ = _series(run)
    kept = [a for t, a in zip(times, accuracies, strict=True) if t <= by]
    if len(kept) < window:
        raise ValueError(f"run {run.name}: {len(kept)} rounds end by {by:.1f} s, need {window}")
    return sum(kept[-window:]) / window


def _bytes_by(run: Run, by: float) -> float:
    """Bytes as sent (up + down) by the end of the run's last round ending by `by`."""
    times, _, sent = _series(run)
    kept = [b for t, b in zip(times, sent, strict=True) if t <= by]
    if not kept or not math.isfinite(kept[-1]) or kept[-1] <= 0:
        raise ValueError(f"run {run.name} recorded no bytes sent by {by:.1f} s")
    return kept[-1]


def _cost_to(run: Run, target: float, window: int, measure: str) -> float | None:
    """Bytes as sent (`measure="bytes"`) or virtual time (`"time"`) by the end of the round
    at which the run reaches `target` (None: never), by fl-run's own rule
    (`reached_target`: the trailing mean over `window`)."""
    times, _, sent = _series(run)  # every row checked before any is read
    hit = reached_target(run.rows, target, window)
    if hit is None:
        return None
    cost = (sent if measure == "bytes" else times)[run.rows.index(hit)]
    if not math.isfinite(cost) or cost <= 0:
        raise ValueError(f"run {run.name} recorded no {measure} by round {hit.get('round')}")
    return cost


def _seed(run: Run) -> str:
    seed = next((o.partition("=")[2] for o in run.overrides if o.startswith("seed=")), None)
    if seed is None or not seed.isdigit():
        raise ValueError(f"run {run.name} names no seed (seed={seed!r})")
    return seed


def _by_seed(arms: dict[str, list[Run]], wanted: Sequence[str]) -> dict[str, dict[str, Run]]:
    """seed -> arm -> its run, for the arms of `wanted` (each must have run)."""
    missing = [arm for arm in wanted if arm not in arms]
    if missing:
        raise ValueError(f"no arm {missing[0]!r}; arms: {sorted(arms)}")
    by_seed: dict[str, dict[str, Run]] = {}
    for arm, runs in arms.items():
        for run in runs:
            by_seed.setdefault(_seed(run), {})[arm] = run
    return by_seed


def _pairs(
    arms: dict[str, list[Run]], reference: str | None, pairs: Pairs
) -> list[tuple[str, str]]:
    """(arm, its reference): the `--pair`s given, else every other arm against `reference`."""
    if pairs:
        arms_paired = [arm for arm, _ in pairs]
        if len(set(arms_paired)) < len(arms_paired):
            raise ValueError("each arm once in --pair (another reference: another run)")
        return list(pairs)
    if reference is None:
        raise ValueError("name a --reference arm or --pair ARM REF")
    return [(arm, reference) for arm in arms if arm != reference]


def _common(by_seed: dict[str, dict[str, Run]], arm: str, reference: str) -> list[str]:
    return sorted((s for s, runs in by_seed.items() if {arm, reference} <= set(runs)), key=int)


def _summary(values: list[float], bounds: tuple[float, float]) -> dict[str, float]:
    mean, lo, hi = interval(values, bounds=bounds) if values else (math.nan,) * 3
    return {"mean": mean, "lo": lo, "hi": hi}


def paired(
    arms: dict[str, list[Run]],
    reference: str | None,
    window: int,
    equal_time: bool,
    *,
    pairs: Pairs = (),
    sent: bool = False,
) -> dict[str, Any]:
    """Per arm, Δ accuracy vs its reference in points on each seed both ran (and with
    `sent`, the ratio of their bytes as sent by the same end), and each seed's T."""
    wanted = _pairs(arms, reference, pairs)
    by_seed = _by_seed(arms, [name for pair in wanted for name in pair])
    ends = {
        seed: min(_series(r)[0][-1] for r in runs.values()) if equal_time else math.inf
        for seed, runs in by_seed.items()
    }
    out: dict[str, Any] = {"budget_s": ends if equal_time else None, "arms": {}}
    for arm, ref in wanted:
        seeds = _common(by_seed, arm, ref)
        runs = [(by_seed[s][arm], by_seed[s][ref], ends[s]) for s in seeds]
        deltas = [100 * (_figure(a, window, t) - _figure(b, window, t)) for a, b, t in runs]
        figure = {"reference": ref, "seeds": seeds, "deltas": deltas, **_summary(deltas, POINTS)}
        if sent:
            ratios = [_bytes_by(a, t) / _bytes_by(b, t) for a, b, t in runs]
            figure["bytes"] = {"ratios": ratios, **_summary(ratios, RATIO)}
        out["arms"][arm] = figure
    return out


def to_target(
    arms: dict[str, list[Run]],
    reference: str,
    window: int,
    margin: float,
    reach: int,
    measure: str = "bytes",
) -> dict[str, Any]:
    """Bytes as sent (or virtual time, `measure`) to the target (the reference's
    last-`window` mean accuracy over its seeds, minus `margin` points; reached by the
    trailing mean over `reach` rounds), arm ÷ reference on each seed both reached it."""
    if measure not in MEASURES:
        raise ValueError(f"measure is one of {MEASURES}, not {measure!r}")
    by_seed = _by_seed(arms, [reference])
    ends = [_figure(run, window, math.inf) for run in arms[reference]]
    target = sum(ends) / len(ends) - margin / 100
    out: dict[str, Any] = {"target": target, "reach_window": reach, "measure": measure}
    out |= {"reference": reference, "arms": {}}
    theirs_by_seed = {  # the reference's cost on each seed it ran, once for every arm
        s: _cost_to(runs[reference], target, reach, measure)
        for s, runs in by_seed.items()
        if reference in runs
    }
    for arm in arms:
        if arm == reference:
            continue
        seeds, ratios, missed = [], [], []
        for s in _common(by_seed, arm, reference):
            mine, theirs = _cost_to(by_seed[s][arm], target, reach, measure), theirs_by_seed[s]
            if theirs is None:
                continue  # the reference itself missed: no pair on this seed
            if mine is None:
                missed.append(s)
                continue
            seeds.append(s)
            ratios.append(mine / theirs)
        out["arms"][arm] = {"seeds": seeds, "ratios": ratios, "missed": missed}
        out["arms"][arm].update(_summary(ratios, RATIO))
    return out


def verdict(lo: float, hi: float, bar: float) -> str:
    """Against Δ ≥ bar: the interval above it, below it, or holding it (the scoreboard's
    rule, `experiments/scoreboard.py`)."""
    return condition_verdict({"rule": "at_least", "lo": lo, "hi": hi, "bar": bar})


def ratio_verdict(figure: dict[str, Any], bar: float) -> str:
    """Against ratio < bar, where a seed on which the arm missed the target (`missed`)
    keeps it from reproducing and more than half missed decide it does not."""
    condition = {"rule": "at_most", "lo": figure["lo"], "hi": figure["hi"], "bar": bar}
    condition |= {"seeds": figure["ratios"], "missed": len(figure.get("missed", []))}
    return condition_verdict(condition)


def _spread(f: dict[str, Any], sign: str = "+") -> str:
    return f"{f['mean']:{sign}.2f} [{f['lo']:{sign}.2f}, {f['hi']:{sign}.2f}]"


def table(result: dict[str, Any], bar: float, ratio_bar: float) -> str:
    """The figures as a Markdown table, a line per arm, and each seed's T where timed."""
    sent = any("bytes" in f for f in result["arms"].values())
    head = ["arm − its reference (points)", "seeds", "mean [95 % CI]", "per seed"]
    head += [f"verdict (Δ ≥ {bar:g})"]
    if sent:
        head += ["bytes ÷ reference", "per seed", f"verdict (÷ < {ratio_bar:g})"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for arm, f in result["arms"].items():
        cells = [
            f"{arm} − {f['reference']}",
            ",".join(f["seeds"]),
            _spread(f),
            " / ".join(f"{d:+.2f}" for d in f["deltas"]),
            verdict(f["lo"], f["hi"], bar),
        ]
        if "bytes" in f:
            b = f["bytes"]
            ratios = " / ".join(f"{r:.3f}" for r in b["ratios"])
            cells += [_spread(b, ""), ratios, ratio_verdict(b, ratio_bar)]
        lines.append("| " + " | ".join(cells) + " |")
    if result["budget_s"]:
        ends = ", ".join(f"seed {s}: {t:.1f}" for s, t in sorted(result["budget_s"].items()))
        lines.append(f"\nEqual virtual time T (s): {ends}.")
    return "\n".join(lines) + "\n"


def target_table(result: dict[str, Any], reference: str, ratio_bar: float) -> str:
    """Bytes (or time) to the target, arm ÷ reference, a line per arm, and the target."""
    what = "bytes" if result["measure"] == "bytes" else "virtual time"
    head = [f"{what} to target, arm ÷ {reference}", "seeds", "mean [95 % CI]", "per seed"]
    head += ["missed on seeds", f"verdict (÷ < {ratio_bar:g})"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for arm, f in result["arms"].items():
        ratios = " / ".join(f"{r:.3f}" for r in f["ratios"])
        spread = _spread(f, "") if f["ratios"] else "—"
        missed = ",".join(f["missed"]) or "none"
        cells = [arm, ",".join(f["seeds"]), spread, ratios, missed, ratio_verdict(f, ratio_bar)]
        lines.append("| " + " | ".join(cells) + " |")
    reach = result["reach_window"]
    lines.append(f"\nTarget accuracy: {result['target']:.4f} (a {reach}-round trailing mean).")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--reference", help="the reference arm's overrides")
    parser.add_argument(
        "--pair",
        nargs=2,
        action="append",
        default=[],
        metavar=("ARM", "REF"),
        help="an arm and its own reference (repeatable; instead of --reference)",
    )
    parser.add_argument("--window", type=int, default=10, help="rounds averaged")
    parser.add_argument("--equal-time", action="store_true", help="at the seed's earliest end")
    parser.add_argument("--bar", type=float, default=0.0, help="the claim: Δ ≥ bar points")
    parser.add_argument("--bytes", action="store_true", help="also bytes as sent, ÷ reference")
    parser.add_argument("--ratio-bar", type=float, default=1.0, help="the claim: ÷ < bar")
    parser.add_argument(
        "--to-target",
        type=int,
        metavar="N",
        help="bytes to the reference's last-N-round mean accuracy minus --margin points",
    )
    parser.add_argument("--margin", type=float, default=1.0, help="points below, for --to-target")
    parser.add_argument("--measure", choices=MEASURES, default="bytes", help="for --to-target")
    parser.add_argument(
        "--reach-window", type=int, default=5, help="trailing rounds (fl-run's target_window)"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if min(args.window, args.reach_window, args.to_target or 1) < 1:
        parser.error("--window, --to-target and --reach-window must be at least 1")
    if (args.reference is None) == (not args.pair):
        parser.error("name either --reference or --pair ARM REF")
    if args.to_target is not None and args.reference is None:
        parser.error("--to-target reads against one --reference")
    try:
        arms = seed_arms([job for sweep in args.sweeps for job in find_runs(sweep)])
        if not arms:
            parser.error("no arm ran several seeds in these sweeps")
        if args.to_target is not None:
            result = to_target(
                arms, args.reference, args.to_target, args.margin, args.reach_window, args.measure
            )
            text = target_table(result, args.reference, args.ratio_bar)
        else:
            pairs = [tuple(p) for p in args.pair]
            result = paired(
                arms, args.reference, args.window, args.equal_time, pairs=pairs, sent=args.bytes
            )
            text = table(result, args.bar, args.ratio_bar)
        if args.json:
            write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    except (ValueError, OSError) as err:  # a missing arm, a bad row, an unreadable file
        print(f"room_table: {err}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
