"""FedSU preset: the comparison table at the last round every arm reached, and one plot of
the share of scalars each arm leaves unsynchronised (FedSU's speculated, APF's frozen).

`fl.run.compare` needs finished runs (summary.json); this reads metrics.jsonl alone, so it also
compares arms stopped early (each resumes from its checkpoint with `resume=true`).

    .venv/bin/python experiments/fedsu_compare.py experiments/out/fedsu/<timestamp> [target]

With several sweeps that differ only in the seed (`--seeds DIR DIR ... [target]`), it prints
each arm's figures as mean ± sample std over them, traffic as ratios to FedAvg's of the
same seed (per-seed values in brackets).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml
from asfl_table import _cell

from fl.common.files import write_atomic
from fl.run.plots import plot_diagnostic

UNSYNCED = ("speculated_fraction", "frozen_fraction")


def _arm(run_dir: Path) -> tuple[str, list[dict[str, Any]]]:
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    name = next(o.split("=", 1)[1] for o in overrides if o.startswith("strategy="))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return name, rows


def _traffic(row: dict[str, Any], kind: str = "") -> int:
    return int(row[f"cum_{kind}bytes_up"] + row[f"cum_{kind}bytes_down"])


def _unsynced(row: dict[str, Any]) -> float | None:
    return next((row[k] for k in UNSYNCED if row.get(k) is not None), None)


def table(arms: dict[str, list[dict[str, Any]]], target: float) -> str:
    """Markdown: each arm cut at the last round all arms reached; traffic vs the first arm."""
    last = min(len(rows) for rows in arms.values())
    ref = next(iter(arms.values()))[last - 1]
    head = ["arm", "acc", "best acc", "MB as sent", "vs ref", "MB payload", "vs ref"]
    head += [f"rounds to {target}", f"MB to {target}", "mean unsynced", "unsynced at end"]
    lines = [f"At round {last}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in arms.items():
        cut, end = rows[:last], rows[last - 1]
        hit = next((r for r in cut if r["accuracy"] >= target), None)
        shares = [s for r in cut if (s := _unsynced(r)) is not None]
        cells = [
            name,
            f"{end['accuracy']:.4f}",
            f"{max(r['accuracy'] for r in cut):.4f}",
            f"{_traffic(end) / 1e6:.1f}",
            f"{_traffic(end) / _traffic(ref):.1%}",
            f"{_traffic(end, 'payload_') / 1e6:.1f}",
            f"{_traffic(end, 'payload_') / _traffic(ref, 'payload_'):.1%}",
            str(hit["round"]) if hit else "not reached",
            f"{_traffic(hit) / 1e6:.1f}" if hit else "not reached",
            f"{sum(shares) / len(shares):.3f}" if shares else "-",
            f"{_unsynced(end):.3f}" if shares else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _arms(sweep: Path) -> dict[str, list[dict[str, Any]]]:
    jobs = sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return dict(_arm(job) for job in jobs)


def _spread(values: list[float], digits: int) -> str:
    """Mean ± sample std (`asfl_table._cell`), then each seed's value."""
    cell = _cell(values, digits)
    return (
        cell
        if cell.startswith("not")
        else f"{cell} ({' / '.join(f'{v:.{digits}f}' for v in values)})"
    )


def seeds_table(sweeps: list[Path], target: float) -> str:
    """Markdown: per arm, mean ± std over the sweeps (seeds) of its figures at the last
    round every arm of every seed reached; traffic relative to FedAvg of the same seed."""
    runs = [_arms(sweep) for sweep in sweeps]
    last = min(len(rows) for arms in runs for rows in arms.values())
    head = ["arm", "final acc", "payload vs FedAvg", "as sent vs FedAvg"]
    head += [f"payload to {target} vs FedAvg", "mean unsynced share"]
    lines = [f"At round {last}, {len(runs)} seeds:", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + "---|" * len(head))
    for name in runs[0]:
        acc, payload, sent, to_target, unsynced = [], [], [], [], []
        for arms in runs:
            rows, ref = arms[name][:last], arms["fedavg"][:last]
            acc.append(rows[-1]["accuracy"])
            payload.append(_traffic(rows[-1], "payload_") / _traffic(ref[-1], "payload_"))
            sent.append(_traffic(rows[-1]) / _traffic(ref[-1]))
            hit = next((r for r in rows if r["accuracy"] >= target), None)
            ref_hit = next((r for r in ref if r["accuracy"] >= target), None)
            to_target.append(
                _traffic(hit, "payload_") / _traffic(ref_hit, "payload_")
                if hit and ref_hit
                else float("nan")
            )
            shares = [v for r in rows if (v := _unsynced(r)) is not None]
            unsynced.append(statistics.mean(shares) if shares else 0.0)
        cells = [
            name,
            _spread(acc, 4),
            _spread(payload, 3),
            _spread(sent, 3),
            _spread(to_target, 3),
            _spread(unsynced, 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--seeds":
        numbers = [a for a in argv[1:] if not Path(a).is_dir()]
        sweeps = [Path(a) for a in argv[1:] if Path(a).is_dir()]
        print(seeds_table(sweeps, float(numbers[0]) if numbers else 0.95))
        return 0
    sweep = Path(argv[0])
    target = float(argv[1]) if len(argv) > 1 else 0.95
    arms = _arms(sweep)
    text = table(arms, target)
    write_atomic(sweep / "comparison_at_common_round.md", text)
    unsynced = {
        name: [{"round": r["round"], "unsynced_fraction": _unsynced(r)} for r in rows]
        for name, rows in arms.items()
    }
    plot_diagnostic(
        unsynced, "unsynced_fraction", sweep / "unsynced_fraction.png", title="not synchronised"
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
