"""Accuracy-vs-bytes Pareto plot and tables of an `fl-run experiment=grafting` sweep.

Each arm (a `strategy=` of the sweep) over its seeds: accuracy at the end of the
equal-virtual-time budget (mean of the last 5 rounds, which is less noisy than the last
one on 360 test images), total bytes up + down, rounds. Then: each graft against the
original whose action and law it keeps, whether MDMA lies on or beyond the Pareto front
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

LAST = 5  # rounds averaged for the end accuracy
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
        arms.setdefault(strategy, []).append(
            {
                "accuracy": statistics.fmean(r["accuracy"] for r in rows[-LAST:]),
                "bytes": last["cum_bytes_up"] + last["cum_bytes_down"],
                "rounds": last["round"],
            }
        )
    return arms


def _mean(runs: list[dict[str, float]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def _std(runs: list[dict[str, float]], key: str) -> float:
    return statistics.stdev(r[key] for r in runs) if len(runs) > 1 else 0.0


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
        f"| arm | seeds | accuracy (last {LAST}) | total MB | bytes vs fedavg | rounds "
        "| on the Pareto front |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, runs in arms.items():
        acc, sd = _mean(runs, "accuracy"), _std(runs, "accuracy")
        total = _mean(runs, "bytes")
        lines.append(
            f"| {s} | {len(runs)} | {acc:.4f} ± {sd:.4f} | {total / 1e6:.2f} | "
            f"{total / ref:.2f} | {_mean(runs, 'rounds'):.0f} | {'yes' if s in front else ''} |"
        )
    lines += ["", "| graft | original | Δ accuracy | bytes ratio | matches with fewer bytes |"]
    lines.append("|---|---|---|---|---|")
    for graft, original in GRAFTS.items():
        if graft not in arms or original not in arms:
            continue
        diff = means[graft][1] - means[original][1]
        noise = max(_std(arms[graft], "accuracy"), _std(arms[original], "accuracy"))
        ratio = means[graft][0] / means[original][0]
        verdict = "yes" if diff >= -noise and ratio < 1 else "no"
        lines.append(f"| {graft} | {original} | {diff:+.4f} | {ratio:.2f} | {verdict} |")
    singles = [means[s] for s in SINGLE_ACTION if s in means]
    for multi in MULTI_ACTION:
        if multi in means:
            held = "on or beyond" if not dominated(means[multi], singles) else "behind"
            lines.append(f"\n{multi} is {held} the single-action schemes' Pareto front.")
    return "\n".join(lines)


def figure(arms: dict[str, list[dict[str, float]]], path: Path) -> None:
    """Accuracy vs total bytes: each seed faint, each arm's mean with ±1 std bars."""
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
            xerr=_std(runs, "bytes") / 1e6,
            yerr=_std(runs, "accuracy"),
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
    fig.savefig(path, dpi=120)
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
    (args.sweeps[0] / "grafting.md").write_text(out + "\n")
    print(out)


if __name__ == "__main__":
    main()
