"""Time-to-accuracy table of an `fl-run experiment=r2sp` sweep, in virtual seconds.

The sweep's own comparison.md counts rounds to the target; R2SP's claim is about time,
and its rounds (one group each) are not BSP's (every client), so this table reads
each arm's metrics.jsonl for the virtual time at which it first reached 0.90 and 0.94,
relative to the first arm (BSP), and its mean time per cycle (every group once).

    python experiments/r2sp_table.py experiments/out/r2sp/<stamp>
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

TARGETS = (0.90, 0.94)


def _arm(job: Path) -> tuple[str, int, list[dict[str, Any]]]:
    """An arm's label (its overrides but `experiment=`), group count and metrics rows."""
    overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
    label = " ".join(o for o in overrides if not o.startswith("experiment="))
    groups = next((int(o.split("=")[1]) for o in overrides if o.startswith("loop.groups=")), 1)
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return label, groups, rows


def _time_to(rows: list[dict[str, Any]], target: float) -> float | None:
    return next((r["virtual_time_s"] for r in rows if r["accuracy"] >= target), None)


def table(sweep: Path) -> str:
    """The Markdown table of the sweep's numbered jobs, first job as the reference."""
    jobs = sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    arms = [_arm(job) for job in jobs]
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
        best = max(r["accuracy"] for r in rows)
        acc = rows[-1]["accuracy"]
        cells += [f"{cycle:.2f}", str(len(rows)), f"{acc:.3f}", f"{best:.3f}", str(staleness)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="the sweep directory of fl-run experiment=r2sp")
    print(table(parser.parse_args().sweep))


if __name__ == "__main__":
    main()
