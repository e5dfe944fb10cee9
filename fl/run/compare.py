"""Side-by-side comparison of runs: Markdown tables and plots from their outputs.

Every Hydra multirun ends with one (`fl.run.sweep.SweepCallback`, whatever the launcher):
`comparison.md`, `comparison.png` and, where the runs report them, plots of strategy
diagnostics in the sweep directory.
Runs are labelled by the overrides that differ between them; when the sweep varies
`seed`, a second table gives each arm's mean over its seeds with its 95 % t-interval, and
a third pairs each arm with the reference arm seed by seed (the first arm, or
`--reference`): its difference in final accuracy and its ratios of traffic and of virtual
time to target, each with its interval, which is what a verdict against a paper's
"x × the baseline" needs.
By hand, on sweep or run directories: `python -m fl.run.compare DIR [DIR ...] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import sys
import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from fl.common.files import TEXT_LIMIT, open_regular, read_regular_text, write_atomic
from fl.run.intervals import (
    ACCURACY,
    DIFFERENCE,
    NON_NEGATIVE,
    Bounds,
    few_seeds_warning,
    interval,
)
from fl.run.tracking import evaluated, run_defining

__all__ = [
    "ARCHIVED_METRICS",
    "NOT_REACHED",
    "Run",
    "compare_runs",
    "find_runs",
    "group_by_arm",
    "load_run",
    "main",
    "paired_figures",
    "seed_arms",
]

log = logging.getLogger(__name__)
NOT_REACHED = "not reached"  # a target a run never reached: one spelling in every table
ARCHIVED_METRICS = "metrics.jsonl.gz"  # a run's rows as experiments/archive_runs.py keeps them

DIAGNOSTICS = (
    "frozen_fraction",
    "speculated_fraction",
    "local_steps",
    "consistency",
    "mean_period",
    "epsilon_max",
)


class Run(NamedTuple):
    """One finished run: its Hydra overrides, metrics rows and summary."""

    name: str
    overrides: list[str]
    rows: list[dict[str, Any]]
    summary: dict[str, Any]


def load_run(run_dir: Path) -> Run:
    """A finished run's outputs; `experiment=` and the invocation's own controls
    and display switches (`resume=`, `overwrite=`, `progress=`, `plots=`:
    `fl.run.tracking.CONTROL_KEYS`) are left out of its overrides."""
    path = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(read_regular_text(path)) if path.exists() else []
    rows = [json.loads(line) for line in _metrics_text(run_dir).splitlines()]
    summary = json.loads(read_regular_text(run_dir / "summary.json"))
    kept = [o for o in run_defining(overrides or []) if not o.startswith("experiment=")]
    return Run(run_dir.name, kept, rows, summary)


def _metrics_text(run_dir: Path) -> str:
    """A run's `metrics.jsonl`, or where only its archive is kept, that archive's text
    (gzip, read up to the limit of a text file: a bomb is refused, not unpacked)."""
    plain, archived = run_dir / "metrics.jsonl", run_dir / ARCHIVED_METRICS
    if plain.exists() or not archived.exists():
        return read_regular_text(plain)
    with open_regular(archived, max_bytes=TEXT_LIMIT) as raw, gzip.open(raw) as unpacked:
        try:
            data = unpacked.read(TEXT_LIMIT + 1)
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            raise ValueError(f"{archived} is not a whole gzip file: {err}") from None
    if len(data) > TEXT_LIMIT:
        raise ValueError(f"{archived} unpacks to more than {TEXT_LIMIT} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{archived} does not unpack to UTF-8 text") from None


def find_runs(path: Path) -> list[Path]:
    """`path` if it is a run directory, else its numbered job directories that hold a run;
    of a sweep whose `sweep.json` lists the jobs it launched, only those (a folder dropped
    in beside them is no arm)."""
    if (path / "summary.json").exists():
        return [path]
    jobs = [p.parent for p in path.glob("*/summary.json") if p.parent.name.isdigit()]
    launched = _launched(path / "sweep.json")
    if launched is not None:
        jobs = [j for j in jobs if j.name in launched]
    return sorted(jobs, key=lambda p: int(p.name))


def _launched(manifest: Path) -> set[str] | None:
    """The job folders a sweep's manifest says it launched; None if it names none."""
    if not manifest.exists():
        return None
    try:
        launched = json.loads(read_regular_text(manifest)).get("launched")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(launched, list) and all(isinstance(n, str) for n in launched):
        return set(launched)
    return None


def _varying(runs: Sequence[Run]) -> list[list[str]]:
    """Each run's overrides that not every run shares (all of them for a single run)."""
    shared = set.intersection(*(set(r.overrides) for r in runs)) if len(runs) > 1 else set()
    return [[o for o in r.overrides if o not in shared] for r in runs]


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(runs: Sequence[Run], labels: Sequence[str]) -> str:
    """One line per run; traffic relative to the first run (the reference arm)."""
    ref = runs[0].summary
    ref_total = ref["total_bytes_up"] + ref["total_bytes_down"]
    ref_payload = ref["total_payload_bytes_up"] + ref["total_payload_bytes_down"]
    present = [k for k in DIAGNOSTICS if any(_mean(r.rows, k) is not None for r in runs)]
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
    lines = [_row(head), "|" + "---|" * len(head)]
    for label, run in zip(labels, runs, strict=True):
        s = run.summary
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
            rounds = s.get("rounds_to_target")
            cells += [
                NOT_REACHED if rounds is None else str(rounds),
                NOT_REACHED if hit is None else f"{hit / 1e6:.1f}",
            ]
        cells += [f"{m:.3f}" if (m := _mean(run.rows, k)) is not None else "-" for k in present]
        lines.append(_row(cells))
    return "\n".join(lines) + "\n"


def _decimals(numbers: Sequence[float], digits: int) -> int:
    """At least `digits` decimals, more where a nonzero number (a mean, an interval's width)
    would otherwise print as 0: two significant digits of the smallest one, up to 12."""
    small = [abs(x) for x in numbers if x != 0 and math.isfinite(x)]
    needed = [math.ceil(-math.log10(x)) + 1 for x in small]
    return min(max([digits, *needed]), 12)


def _spread(
    values: Sequence[float],
    digits: int,
    bounds: Bounds = NON_NEGATIVE,
    identity: float | None = None,
) -> str:
    """Mean [95 % t-interval over seeds, clipped to `bounds`]; one seed has no interval;
    "identical" where every value is `identity` (a difference of 0, a ratio of 1)."""
    if identity is not None and len(values) > 1 and all(v == identity for v in values):
        return f"identical (all {len(values)} seeds)"
    mean, low, high = interval(values, bounds=bounds)
    places = _decimals([mean, high - low], digits)
    if len(values) < 2:
        return f"{mean:.{places}f} (1 seed)"
    return f"{mean:.{places}f} [{low:.{places}f}, {high:.{places}f}]"


def group_by_arm(labelled: Iterable[tuple[str, Hashable, Run]]) -> dict[str, dict[Any, Run]]:
    """(arm, seed, run) triples as arm -> seed -> run. An arm that ran a seed twice (a
    sweep read twice, or two sweeps with the same seed) is refused: pairing and intervals
    would count that seed twice."""
    arms: dict[str, dict[Any, Run]] = {}
    for arm, seed, run in labelled:
        twin = arms.setdefault(arm, {}).get(seed)
        if twin is not None:
            raise ValueError(
                f"arm {arm!r} ran seed {seed} twice (jobs {twin.name} and {run.name}): "
                "read each sweep once, and each seed from one sweep"
            )
        arms[arm][seed] = run
    return arms


def _arms(runs: Sequence[Run], varying: Sequence[list[str]]) -> dict[str, list[Run]]:
    """Runs grouped by arm (equal but for `seed=`; `group_by_arm`); {} unless some arm has
    several seeds."""
    if not any(o.startswith("seed=") for overrides in varying for o in overrides):
        return {}

    def arm(overrides: list[str]) -> str:
        return " ".join(o for o in overrides if not o.startswith("seed=")) or "all runs"

    by_seed = group_by_arm((arm(o), _seed_of(r), r) for o, r in zip(varying, runs, strict=True))
    if len(by_seed) == len(runs):
        return {}  # no arm ran several seeds
    return {name: list(seeds.values()) for name, seeds in by_seed.items()}


def _seed_table(arms: Mapping[str, list[Run]], runs: Sequence[Run]) -> str:
    """One line per arm: the mean over its seeds and the 95 % t-interval of that mean."""
    target = runs[0].summary.get("target_accuracy")
    head = ["arm", "seeds", "final acc", "best acc", "traffic MB (as sent)", "virtual time s"]
    head += (
        [f"reached {target}", f"rounds to {target}", f"virtual s to {target}"]
        if target is not None
        else []
    )
    lines = [_row(head), "|" + "---|" * len(head)]
    for arm, members in arms.items():
        s = [m.summary for m in members]
        cells = [
            arm,
            str(len(members)),
            _spread([x["final_accuracy"] for x in s], 4, ACCURACY),
            _spread([x["best_accuracy"] for x in s], 4, ACCURACY),
            _spread([(x["total_bytes_up"] + x["total_bytes_down"]) / 1e6 for x in s], 1),
            _spread([x["virtual_time_s"] for x in s], 1),
        ]
        if target is not None:
            hits = [x for x in s if x.get("rounds_to_target") is not None]
            cells += [
                f"{len(hits)}/{len(s)}",
                _spread([x["rounds_to_target"] for x in hits], 1) if hits else NOT_REACHED,
                _spread([x["time_to_target_s"] for x in hits], 1) if hits else NOT_REACHED,
            ]
        lines.append(_row(cells))
    return "\n".join(lines) + "\n"


def _seed_of(run: Run) -> str | None:
    return next((o.partition("=")[2] for o in run.overrides if o.startswith("seed=")), None)


def _traffic(summary: dict[str, Any]) -> float:
    return float(summary["total_bytes_up"] + summary["total_bytes_down"])


def seed_arms(run_dirs: Sequence[Path]) -> dict[str, list[Run]]:
    """The runs of `run_dirs` grouped by arm, labelled as the comparison's tables label them
    ({} unless some arm ran several seeds)."""
    runs = [load_run(d) for d in run_dirs]
    return _arms(runs, _varying(runs))


def paired_figures(
    arms: Mapping[str, list[Run]], reference: str
) -> dict[str, dict[str, list[float]]]:
    """Each arm against `reference` on the seeds both ran, one value per seed: Δ final
    accuracy (`final_accuracy`), `traffic` × and virtual time to target × (`time_to_target`,
    the seeds where both reached it)."""
    ref = {_seed_of(r): r.summary for r in arms[reference]}
    out = {}
    for arm, members in arms.items():
        pairs = [(m.summary, ref[seed]) for m in members if (seed := _seed_of(m)) in ref]
        if arm == reference or not pairs:
            continue
        out[arm] = {
            "final_accuracy": [a["final_accuracy"] - b["final_accuracy"] for a, b in pairs],
            "traffic": [_traffic(a) / _traffic(b) for a, b in pairs],
            "time_to_target": [
                a["time_to_target_s"] / b["time_to_target_s"]
                for a, b in pairs
                if a.get("time_to_target_s") is not None and b.get("time_to_target_s")
            ],
        }
    return out


def _paired_table(arms: Mapping[str, list[Run]], reference: str) -> str:
    """Each arm against `reference` on the seeds both ran: Δ final accuracy, traffic ×
    and virtual time to target × (seeds where both reached it), mean [95 % t-interval]."""
    head = ["arm", "seeds paired", "Δ final acc", "traffic ×", "virtual s to target ×"]
    lines = [_row(head), "|" + "---|" * len(head)]
    targeted = arms[reference][0].summary.get("target_accuracy") is not None
    for arm, figures in paired_figures(arms, reference).items():
        times = figures["time_to_target"]
        lines.append(
            _row(
                [
                    arm,
                    str(len(figures["traffic"])),
                    _spread(figures["final_accuracy"], 4, DIFFERENCE, identity=0.0),
                    _spread(figures["traffic"], 3, identity=1.0),
                    f"{_spread(times, 3, identity=1.0)} ({len(times)} seeds)"
                    if times
                    else NOT_REACHED
                    if targeted
                    else "-",
                ]
            )
        )
    return "\n".join(lines) + "\n"


def compare_runs(
    run_dirs: Sequence[Path],
    out_dir: Path,
    title: str = "",
    *,
    plots: bool = True,
    reference: str | None = None,
) -> str:
    """Write comparison.md and (with `plots`) plots for `run_dirs` into `out_dir`; return the
    Markdown. `reference`: the arm the paired table compares with (default: the first)."""
    # Here, not at the top: every fl-run loads this module (the sweep callback), few plot.
    from fl.run.plots import plot_diagnostic, plot_runs

    runs = [load_run(d) for d in run_dirs]
    varying = _varying(runs)
    labels = [" ".join(v) or r.name for v, r in zip(varying, runs, strict=True)]
    text = _table(runs, labels)
    arms = _arms(runs, varying)
    if arms:
        warning = few_seeds_warning(min(len(members) for members in arms.values()))
        if warning:
            log.warning("comparison: %s", warning)
            text += f"\n**Warning:** {warning}.\n"
        text += (
            "\nMean over seeds [95 % t-interval of the mean, clipped to the figure's range: "
            "accuracy to [0, 1], traffic, times and ratios to >= 0]; a verdict against a "
            "paper's figure is inconclusive while its interval holds it:\n\n"
            f"{_seed_table(arms, runs)}"
        )
        ref = reference if reference is not None else next(iter(arms))
        if ref not in arms:
            raise ValueError(f"reference arm {ref!r} is none of {sorted(arms)}")
        if len(arms) > 1:
            text += (
                f"\nPaired with `{ref}` seed by seed, mean [95 % t-interval] of the "
                f"differences and ratios:\n\n{_paired_table(arms, ref)}"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "comparison.md", f"# {title}\n\n{text}" if title else text)
    if not plots:
        return text
    series = dict(zip(labels, (r.rows for r in runs), strict=True))
    if arms:  # one line per arm, the mean over its seeds, in a band of their interval
        plot_runs(
            {a: [evaluated(r.rows) for r in m] for a, m in arms.items()},
            out_dir / "comparison.png",
            title=title,
        )
    else:
        tested = {k: [evaluated(v)] for k, v in series.items()}
        plot_runs(tested, out_dir / "comparison.png", title=title)
    for key in DIAGNOSTICS:
        reported = {label: rows for label, rows in series.items() if _mean(rows, key) is not None}
        if reported:
            plot_diagnostic(reported, key, out_dir / f"{key}.png", title=title)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fl.run.compare`: compare run and sweep directories; 2 if one holds no run."""
    parser = argparse.ArgumentParser(
        prog="python -m fl.run.compare",
        description="Compare finished runs: write comparison.md, comparison.png and "
        "diagnostic plots (what every multirun writes into its sweep directory).",
    )
    parser.add_argument(
        "dirs",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="a run directory (holds summary.json) or a sweep directory (its numbered jobs)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where the outputs go (default: DIR when one is given, else the current directory)",
    )
    parser.add_argument(
        "--title", metavar="TEXT", help="heading of the table and plots (default: --out's name)"
    )
    parser.add_argument(
        "--reference",
        metavar="ARM",
        help="the arm (its label in the seed table) the paired table compares with "
        "(default: the first arm)",
    )
    args = parser.parse_args(argv)
    run_dirs = []
    for path in args.dirs:
        found = find_runs(path)
        if not found:
            print(
                f"fl.run.compare: {path} holds no run "
                "(no summary.json in it or in its numbered job directories)",
                file=sys.stderr,
            )
            return 2
        run_dirs += found
    out = args.out or (args.dirs[0] if len(args.dirs) == 1 else Path.cwd())
    title = args.title if args.title is not None else out.resolve().name
    try:
        print(compare_runs(run_dirs, out, title, reference=args.reference))
    except ValueError as err:
        print(f"fl.run.compare: {err}", file=sys.stderr)
        return 2
    print(f"comparison written to {out / 'comparison.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
