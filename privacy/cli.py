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
import re
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from fl.common.errors import RunError
from fl.common.files import make_dir, require_regular, write_atomic

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
    make_dir(path.parent)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
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
    out = Path(args.out) if args.out else None
    if out is not None:
        make_dir(out)  # before the study: a bad --out fails at once
    result = compare(workload, tuple(args.betas), dpf_n=args.dpf_n, kappa_max=args.kappa_max)
    table = markdown_table(result)
    print(table)
    if out is not None:
        name = args.name
        write_atomic(out / f"{name}.json", json.dumps(result, indent=2) + "\n")
        write_atomic(out / f"{name}.md", table)
        plot(result, out / f"{name}.png")
        print(f"wrote {out}/{name}.{{json,md,png}}")
    return 0


def _shown(text: object) -> str:
    """A ledger's text as printable characters only: its notes and ids are untrusted."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _ledger(args: argparse.Namespace) -> int:
    """Print a ledger and check it, writing nothing (a lapsed lease is shown, not reclaimed)."""
    from privacy.ledger import Ledger

    with Ledger(args.path, readonly=True) as ledger:
        problems = ledger.check()
        try:
            _list(ledger)
        except (TypeError, ValueError) as err:  # a damaged value: the check says which
            print(f"(listing stopped at a value that is not a number: {_shown(err)})")
    print(
        "consistent" if not problems else "INCONSISTENT:\n  " + "\n  ".join(map(_shown, problems))
    )
    return 1 if problems else 0


def _list(ledger: Any) -> None:
    """Each pipeline's state, grant, spend and lease, then the blocks' totals."""
    now = time.time()
    rows = ledger.db.execute("SELECT id FROM pipelines ORDER BY arrival, rowid").fetchall()
    for (pid,) in rows:
        r = ledger.pipeline(pid)
        assert r is not None
        line = f"{_shown(pid):<24} {_shown(r.analyst):<12} {_shown(r.status):<9} "
        line += f"κ={r.kappa or 0:.3f} granted Σε={sum(r.granted.values()):.4g} "
        line += f"spent Σε={sum(r.spent.values()):.4g} "
        line += f"δ={max(r.delta_granted.values(), default=0):.3g}"
        if r.lease_until is not None:
            left = r.lease_until - now
            lease = f"{left:.0f} s left" if left >= 0 else f"lapsed {-left:.0f} s ago"
            line += f"  lease {lease} ({_shown(r.holder)})"
        print(line + (f"  ({_shown(r.note)})" if r.note else ""))
    blocks = ledger.blocks()
    total = sum(b for b, _ in blocks.values())
    used = sum(a for _, a in blocks.values())
    delta = max((a for _, a in ledger.delta_blocks().values()), default=0.0)
    print(
        f"{len(blocks)} blocks, budget Σε={total:.4g}, allocated Σε={used:.4g}, "
        f"largest δ allocated {delta:.3g}"
    )


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


def _integer(low: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is not an integer >= {low}")
        return value

    return parse


_positive = _integer(1)


def _finite(low: float, strict: bool) -> Any:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"{text} is not a finite number {'>' if strict else '>='} {low}"
            )
        return value

    return parse


def _stem(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", text) or ".." in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a plain file name stem")
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m privacy.cli", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="DPBalance vs DPF, DPK, FCFS on the paper's workload")
    sim.add_argument("--out", help="folder for NAME.{json,md,png}")
    sim.add_argument(
        "--name", type=_stem, default="dpbalance_sim", help="file name stem of the outputs"
    )
    sim.add_argument("--devices", type=_positive, default=100)
    sim.add_argument("--rounds", type=_positive, default=10)
    sim.add_argument("--analysts", type=_positive, default=6)
    sim.add_argument("--pipelines", type=_positive, default=25, help="pipelines per analyst")
    sim.add_argument("--betas", type=_finite(0, True), nargs="+", default=[0.5, 2.2, 5.0])
    sim.add_argument(
        "--budget", type=_finite(0, True), nargs=2, default=[1.0, 1.5], help="device ε ~ U(a, b)"
    )
    sim.add_argument(
        "--dpf-n", type=_positive, default=100, help="DPF-N: arrivals to unlock a block"
    )
    sim.add_argument("--kappa-max", type=_finite(1, False), default=None, help="cap DPBalance's κ")
    sim.add_argument("--seed", type=_integer(0), default=0)
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
    if args.command == "simulate" and args.budget[0] > args.budget[1]:
        parser.error(
            f"--budget {args.budget[0]:g} {args.budget[1]:g}: the first must be <= the second"
        )
    from privacy.ledger import LedgerError

    try:
        if args.command != "simulate":
            require_regular(args.path)  # a FIFO or a device is refused, not waited on
        return int(args.func(args))
    except (LedgerError, RunError) as err:
        print(f"privacy.cli: error: {_shown(err)}", file=sys.stderr)
    except sqlite3.Error as err:
        print(
            f"privacy.cli: error: {_shown(args.path)} is not a readable ledger: {err}",
            file=sys.stderr,
        )
    except OSError as err:
        print(f"privacy.cli: error: {_shown(err)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
