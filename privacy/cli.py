"""`python -m privacy.cli`: the DPBalance scheduling study, and a ledger's pipelines by hand.

python -m privacy.cli simulate --out experiments/out/dpbalance
python -m privacy.cli ledger outputs/dpbalance/ledger.sqlite
python -m privacy.cli release outputs/dpbalance/ledger.sqlite PIPELINE   # a granted one
python -m privacy.cli cancel outputs/dpbalance/ledger.sqlite PIPELINE    # a waiting one
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "markdown_table", "plot"]

NAMES = {"dpbalance": "DPBalance", "dpf": "DPF", "dpk": "DPK", "fcfs": "FCFS"}


def _fmt(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def markdown_table(result: dict[str, Any]) -> str:
    """Cumulative efficiency and fairness per scheduler and β, with DPBalance's gains."""
    lines = [
        "| β | scheduler | efficiency Σ U | fairness Σ f_β | Jain | served | Σ κ "
        "| DPBalance eff. gain | DPBalance fair. gain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["table"]:
        for name in ("dpbalance", "dpf", "dpk", "fcfs"):
            s = row[name]
            gains = (
                ("", "")
                if name == "dpbalance"
                else (
                    f"{row[f'efficiency_gain_vs_{name}']:.2f}×",
                    f"{row[f'fairness_gain_vs_{name}']:.2f}×",
                )
            )
            lines.append(
                f"| {row['beta']} | {NAMES[name]} | {_fmt(s['efficiency'])} | "
                f"{_fmt(s['fairness'])} | {_fmt(s['jain'])} | {s['served']} | "
                f"{s['kappa_sum']:.1f} | {gains[0]} | {gains[1]} |"
            )
    lines += ["", "| β (DPBalance) | efficiency Σ U | Jain |", "|---|---|---|"]
    lines += [
        f"| {t['beta']} | {_fmt(t['efficiency'])} | {_fmt(t['jain'])} |"
        for t in result["trade_off"]
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars of cumulative efficiency and Jain fairness per β, and the β trade-off curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = ("dpbalance", "dpf", "dpk", "fcfs")
    width = 0.2
    for ax, key, label in (
        (axes[0], "efficiency", "cumulative efficiency Σ U_i"),
        (axes[1], "jain", "mean Jain index of U_i"),
    ):
        for k, name in enumerate(names):
            values = [row[name][key] for row in result["table"]]
            xs = [i + (k - 1.5) * width for i in range(len(values))]
            ax.bar(xs, values, width, label=NAMES[name])
        ax.set_xticks(range(len(result["table"])))
        ax.set_xticklabels([f"β={row['beta']}" for row in result["table"]])
        ax.set_title(label)
    axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4, fontsize=8)
    sweep = result["trade_off"]
    axes[2].plot([t["beta"] for t in sweep], [t["efficiency"] for t in sweep], "o-", label="eff.")
    twin = axes[2].twinx()
    twin.plot([t["beta"] for t in sweep], [t["jain"] for t in sweep], "s--", color="C3")
    axes[2].set_xlabel("β")
    axes[2].set_ylabel("efficiency Σ U_i")
    twin.set_ylabel("Jain index", color="C3")
    axes[2].set_title("DPBalance: efficiency vs fairness")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _simulate(args: argparse.Namespace) -> int:
    from privacy.simulation import Workload, compare

    workload = Workload(
        devices=args.devices,
        rounds=args.rounds,
        analysts=args.analysts,
        pipelines_per_analyst=args.pipelines,
        budget=(args.budget[0], args.budget[1]),
        seed=args.seed,
    )
    result = compare(workload, tuple(args.betas), dpf_n=args.dpf_n, kappa_max=args.kappa_max)
    table = markdown_table(result)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = args.name
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"{name}.md").write_text(table)
        plot(result, out / f"{name}.png")
        print(f"wrote {out}/{name}.{{json,md,png}}")
    return 0


def _ledger(args: argparse.Namespace) -> int:
    from privacy.ledger import Ledger

    with Ledger(args.path, create=False) as ledger:
        for pipeline in ledger.reclaim():
            print(f"reclaimed {pipeline}: its lease had lapsed")
        now = time.time()
        rows = ledger.db.execute("SELECT id FROM pipelines ORDER BY arrival, rowid").fetchall()
        for (pid,) in rows:
            r = ledger.pipeline(pid)
            assert r is not None
            line = f"{pid:<24} {r.analyst:<12} {r.status:<9} κ={r.kappa or 0:.3f} "
            line += (
                f"granted Σε={sum(r.granted.values()):.4g} spent Σε={sum(r.spent.values()):.4g} "
            )
            line += f"δ={max(r.delta_granted.values(), default=0):.3g}"
            if r.lease_until is not None:
                line += f"  lease {r.lease_until - now:.0f} s left ({r.holder})"
            print(line + (f"  ({r.note})" if r.note else ""))
        blocks = ledger.blocks()
        total = sum(b for b, _ in blocks.values())
        used = sum(a for _, a in blocks.values())
        delta = max((a for _, a in ledger.delta_blocks().values()), default=0.0)
        print(
            f"{len(blocks)} blocks, budget Σε={total:.4g}, allocated Σε={used:.4g}, "
            f"largest δ allocated {delta:.3g}"
        )
        problems = ledger.check()
    print("consistent" if not problems else "INCONSISTENT:\n  " + "\n  ".join(problems))
    return 1 if problems else 0


def _end(args: argparse.Namespace) -> int:
    from privacy.ledger import Ledger

    status = {"release": "released", "cancel": "cancelled"}[args.command]
    with Ledger(args.path, create=False) as ledger:
        before = ledger.pipeline(args.pipeline)
        ledger.set_status(args.pipeline, status, args.note or f"{status} by hand")
    assert before is not None
    back = {b: e - before.spent[b] for b, e in before.granted.items() if e > before.spent[b]}
    line = f"{status} pipeline {args.pipeline!r}"
    print(
        line + (f": ε {sum(back.values()):.4g} went back to {len(back)} block(s)" if back else "")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m privacy.cli", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="DPBalance vs DPF, DPK, FCFS on the paper's workload")
    sim.add_argument("--out", help="folder for NAME.{json,md,png}")
    sim.add_argument("--name", default="dpbalance_sim", help="file name stem of the outputs")
    sim.add_argument("--devices", type=int, default=100)
    sim.add_argument("--rounds", type=int, default=10)
    sim.add_argument("--analysts", type=int, default=6)
    sim.add_argument("--pipelines", type=int, default=25, help="pipelines per analyst")
    sim.add_argument("--betas", type=float, nargs="+", default=[0.5, 2.2, 5.0])
    sim.add_argument("--budget", type=float, nargs=2, default=[1.0, 1.5], help="device ε ~ U(a, b)")
    sim.add_argument("--dpf-n", type=int, default=100, help="DPF-N: arrivals to unlock a block")
    sim.add_argument("--kappa-max", type=float, default=None, help="cap DPBalance's κ")
    sim.add_argument("--seed", type=int, default=0)
    sim.set_defaults(func=_simulate)
    led = sub.add_parser("ledger", help="pipelines, grants and an invariant check of a ledger")
    led.add_argument("path")
    led.set_defaults(func=_ledger)
    for name, what in (("release", "a granted pipeline's"), ("cancel", "a waiting pipeline's")):
        end = sub.add_parser(name, help=f"end {what} claim; its unspent budget goes back")
        end.add_argument("path")
        end.add_argument("pipeline")
        end.add_argument("--note", help="why (kept in the ledger)")
        end.set_defaults(func=_end)
    args = parser.parse_args(argv)
    from privacy.ledger import LedgerError

    try:
        return int(args.func(args))
    except LedgerError as err:
        print(f"privacy.cli: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
