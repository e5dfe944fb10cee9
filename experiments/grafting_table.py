"""Accuracy-vs-bytes Pareto plot and tables of an `fl-run experiment=grafting` sweep.

Each arm (a `strategy=` of the sweep) over its seeds: accuracy at the end of the
equal-virtual-time budget (mean of the last 5 rounds, which is less noisy than the last
one on 360 test images), total bytes up + down, rounds, each a mean with its 95 %
t-interval over seeds. Then: each graft against the original whose action and law it
keeps, paired seed by seed (Δ accuracy and bytes ratio with their intervals; "matches
with fewer bytes" only when the bytes interval lies below 1 and the accuracy interval above
−`MATCH` points, "no" when either interval lies wholly on the wrong side, else
inconclusive), whether MDMA lies on or beyond the Pareto front
of the single-action schemes, and (with `--oracle`) the diagnosis precision/recall
table written by experiments/grafting_oracle.py.

    python experiments/grafting_table.py experiments/out/grafting/<stamp> [<more sweep dirs>] \
        [--oracle experiments/out/grafting_oracle/<stamp>] [--figure PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import yaml

from fl.common.files import write_atomic
from fl.run.intervals import interval

LAST = 5  # rounds averaged for the end accuracy
MATCH = 0.01  # our tolerance for "matches the original's accuracy": one point (3.6 images)
# graft -> the original whose action and law it keeps
GRAFTS = {"graft_adacomm": "adacomm", "graft_adaquantfl": "adaquantfl", "graft_apf": "apf"}
SINGLE_ACTION = ("fedavg", "adacomm", "adaquantfl", "apf", "gift", *GRAFTS)
MULTI_ACTION = ("graft_sdma", "graft_mdma")


def _jobs(sweeps: list[Path]) -> list[Path]:
    """The numbered job directories of the sweeps, in order."""
    return [
        job
        for sweep in sweeps
        for job in sorted(
            (p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
        )
    ]


def _arms(sweeps: list[Path]) -> dict[str, list[dict[str, float]]]:
    """strategy -> one {accuracy, bytes, rounds} per finished seed."""
    arms: dict[str, list[dict[str, float]]] = {}
    for job in _jobs(sweeps):
        if not (job / "summary.json").exists():
            continue
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
        strategy = next(o.split("=", 1)[1] for o in overrides if o.startswith("strategy="))
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        last = rows[-1]
        seed = int(yaml.safe_load((job / "config.yaml").read_text())["seed"])
        arms.setdefault(strategy, []).append(
            {
                "seed": seed,
                "accuracy": statistics.fmean(r["accuracy"] for r in rows[-LAST:]),
                "bytes": last["cum_bytes_up"] + last["cum_bytes_down"],
                "rounds": last["round"],
            }
        )
    return arms


def _mean(runs: list[dict[str, float]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def _spread(values: list[float], digits: int, sign: str = "") -> str:
    """Mean [95 % t-interval]."""
    mean, low, high = interval(values)
    return f"{mean:{sign}.{digits}f} [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"


def _half(runs: list[dict[str, float]], key: str) -> float:
    """Half the width of the 95 % t-interval of the mean (error bars)."""
    _, low, high = interval([r[key] for r in runs])
    return (high - low) / 2


def _paired(graft: list[dict[str, float]], original: list[dict[str, float]]) -> str:
    """A graft against its original on the seeds both ran: Δ accuracy, bytes ratio, verdict."""
    theirs = {r["seed"]: r for r in original}
    pairs = [(r, theirs[r["seed"]]) for r in graft if r["seed"] in theirs]
    delta = [a["accuracy"] - b["accuracy"] for a, b in pairs]
    ratio = [a["bytes"] / b["bytes"] for a, b in pairs]
    (_, d_low, d_high), (_, r_low, r_high) = interval(delta), interval(ratio)
    if r_high < 1 and d_low >= -MATCH:
        verdict = "yes"
    elif r_low >= 1 or d_high < -MATCH:
        verdict = "no"
    else:
        verdict = "inconclusive"
    return f"{len(pairs)} | {_spread(delta, 4, '+')} | {_spread(ratio, 2)} | {verdict}"


def dominated(point: tuple[float, float], others: list[tuple[float, float]]) -> bool:
    """Whether some (bytes, accuracy) in `others` has no more bytes and no less accuracy,
    and is better in one of them."""
    b, a = point
    return any(ob <= b and oa >= a and (ob < b or oa > a) for ob, oa in others)


def tables(arms: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: per arm; grafts vs originals; the MDMA check."""
    means = {s: (_mean(r, "bytes"), _mean(r, "accuracy")) for s, r in arms.items()}
    front = [s for s in arms if not dominated(means[s], [means[o] for o in arms if o != s])]
    ref = means.get("fedavg", next(iter(means.values())))[0]
    lines = [
        f"| arm | seeds | accuracy (last {LAST}), mean [95 % t-interval] | total MB "
        "| bytes vs fedavg | rounds "
        "| on the Pareto front |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, runs in arms.items():
        total = _mean(runs, "bytes")
        lines.append(
            f"| {s} | {len(runs)} | {_spread([r['accuracy'] for r in runs], 4)} "
            f"| {total / 1e6:.2f} | "
            f"{total / ref:.2f} | {_mean(runs, 'rounds'):.0f} | {'yes' if s in front else ''} |"
        )
    lines += [
        "",
        "| graft | original | seeds paired | Δ accuracy | bytes ratio "
        f"| matches with fewer bytes (Δ ≥ −{MATCH:.2f}) |",
        "|---|---|---|---|---|---|",
    ]
    for graft, original in GRAFTS.items():
        if graft in arms and original in arms:
            lines.append(f"| {graft} | {original} | {_paired(arms[graft], arms[original])} |")
    singles = [means[s] for s in SINGLE_ACTION if s in means]
    for multi in MULTI_ACTION:
        if multi in means:
            held = "on or beyond" if not dominated(means[multi], singles) else "behind"
            lines.append(f"\n{multi} is {held} the single-action schemes' Pareto front.")
    return "\n".join(lines)


def figure(arms: dict[str, list[dict[str, float]]], path: Path) -> None:
    """Accuracy vs total bytes: each seed faint, each arm's mean with its 95 % interval bars."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, (s, runs) in enumerate(arms.items()):
        colour = f"C{i % 10}"
        marker = "*" if s in MULTI_ACTION else ("s" if s in GRAFTS else "o")
        ax.scatter(
            [r["bytes"] / 1e6 for r in runs],
            [r["accuracy"] for r in runs],
            color=colour,
            alpha=0.3,
            s=15,
            marker=marker,
        )
        ax.errorbar(
            _mean(runs, "bytes") / 1e6,
            _mean(runs, "accuracy"),
            xerr=_half(runs, "bytes") / 1e6,
            yerr=_half(runs, "accuracy"),
            color=colour,
            marker=marker,
            markersize=9,
            label=s,
            capsize=3,
        )
    ax.set_xlabel("total bytes up + down (MB)")
    ax.set_ylabel(f"test accuracy (mean of the last {LAST} rounds)")
    ax.set_title("Metric grafting at equal virtual time (3 seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", type=Path, nargs="+", help="sweep dirs (one, or its parts)")
    parser.add_argument("--oracle", type=Path, help="a grafting_oracle.py output directory")
    parser.add_argument("--figure", type=Path, help="default: <sweep>/grafting_pareto.png")
    args = parser.parse_args()
    arms = _arms(args.sweeps)
    out = tables(arms)
    if args.oracle is not None:
        out += "\n\nDiagnosis accuracy against the oracle:\n\n"
        out += (args.oracle / "oracle.md").read_text()
    figure(arms, args.figure or args.sweeps[0] / "grafting_pareto.png")
    write_atomic(args.sweeps[0] / "grafting.md", out + "\n")
    print(out)


if __name__ == "__main__":
    main()
