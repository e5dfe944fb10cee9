"""Diagnosis accuracy against an oracle: fork a run into branches with and without an action.

Every definition here is OURS (the grafting paper's text is not available; spec
algorithms_b.md §4.3 sketches the idea). On the `experiment=grafting` setup, one seed:

- base run: FedAvg at period τ with every diagnosis logged (`strategy=graft action=none
  monitor=<all>`), keeping a checkpoint of every round (`checkpoint_history=true`);
- at every fork round r, three branches that do the same local computation:
  keep (the base run itself, h more rounds at τ), faster (a fork: τ/2 for 2h rounds)
  and slower (a fork: 2τ for h/2 rounds);
- stagnation at r: faster ends at least δ more accurate than keep (syncing more often
  helps now: PAS/GIFT's cue to shorten τ);
- maturity at r: slower ends at most δ less accurate than keep (syncing less often costs
  nothing now: APF/AdaComm's cue to sync less);
- a diagnosis signals stagnation at r when its global value made no new low in the last
  W rounds (GIFT/PAS's plateau test), maturity when it is at most half its first value
  (the ratio law's reading);
- precision and recall over the fork rounds; lead time = first stagnation (maturity)
  round minus the first round the diagnosis signalled it (positive: it warned early).

    python experiments/grafting_oracle.py [--out DIR] [--rounds 40] [--every 4]

Writes `oracle.json` and `oracle.md` into DIR (default experiments/out/grafting_oracle/<stamp>).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fl.common.files import write_atomic

DIAGNOSES = ("loss", "consistency", "stepping", "oscillation", "relevance", "significance")
SETUP = [
    "experiment=grafting",
    "hydra.mode=RUN",
    "strategy=graft",
    "strategy.action=none",
    f"strategy.monitor={'+'.join(DIAGNOSES)}",
    "time_budget_s=null",
    "progress=false",
]
ENV = {
    **os.environ,
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def fl_run(run_dir: Path, *overrides: str) -> list[dict[str, Any]]:
    """Run `fl-run` into `run_dir` (skipped when it already finished); its metrics rows."""
    if not (run_dir / "summary.json").exists():
        cmd = [sys.executable, "-m", "fl.run", *SETUP, f"hydra.run.dir={run_dir}", *overrides]
        subprocess.run(cmd, check=True, env=ENV, capture_output=True, text=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def plateau(values: list[float], r: int, window: int) -> bool:
    """No new low in rounds r-window+1..r (1-based) below the minimum before them."""
    if r <= window:
        return False
    return min(values[r - window : r]) >= min(values[: r - window])


def settled(values: list[float], r: int) -> bool:
    """The value at round r is at most half the first."""
    return values[r - 1] <= 0.5 * values[0]


def score(truth: dict[int, bool], signal: dict[int, bool], every_round: list[bool]) -> dict:
    """Precision, recall and lead time of one diagnosis for one event."""
    tp = sum(truth[r] and signal[r] for r in truth)
    fp = sum(signal[r] and not truth[r] for r in truth)
    fn = sum(truth[r] and not signal[r] for r in truth)
    first_true = min((r for r in truth if truth[r]), default=None)
    first_signal = next((i + 1 for i, s in enumerate(every_round) if s), None)
    lead = None if first_true is None or first_signal is None else first_true - first_signal
    return {
        "precision": tp / (tp + fp) if tp + fp else None,
        "recall": tp / (tp + fn) if tp + fn else None,
        "lead_rounds": lead,
        "signalled": sum(signal.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    parser.add_argument("--out", type=Path, default=Path("experiments/out/grafting_oracle") / stamp)
    parser.add_argument("--rounds", type=int, default=40, help="rounds of the base run")
    parser.add_argument("--every", type=int, default=4, help="rounds between forks")
    parser.add_argument("--horizon", type=int, default=4, help="h: rounds of the keep branch")
    parser.add_argument("--delta", type=float, default=0.005, help="δ: accuracy margin")
    parser.add_argument("--window", type=int, default=3, help="W of the plateau signal")
    parser.add_argument("--steps", type=int, default=20, help="τ: local steps of the base run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="forks run at once")
    parser.add_argument("extra", nargs="*", help="more fl-run overrides (e.g. num_clients=6)")
    args = parser.parse_args()
    h, tau, out = args.horizon, args.steps, args.out.resolve()
    common = [f"seed={args.seed}", f"local_steps={tau}", *args.extra]
    base = fl_run(
        out / "base",
        *common,
        f"rounds={args.rounds}",
        "checkpoint_history=true",
        "checkpoint_every=1",
    )
    forks = list(range(args.every, args.rounds - h + 1, args.every))

    def branch(r: int, name: str, steps: int, rounds: int) -> float:
        rows = fl_run(
            out / f"fork{r:03d}-{name}",
            *common,
            f"fork_from={out / 'base'}@{r}",
            f"local_steps={steps}",
            f"rounds={r + rounds}",
        )
        return float(rows[-1]["accuracy"])

    with ThreadPoolExecutor(args.jobs) as pool:
        faster = dict(
            zip(forks, pool.map(lambda r: branch(r, "faster", tau // 2, 2 * h), forks), strict=True)
        )
        slower = dict(
            zip(forks, pool.map(lambda r: branch(r, "slower", 2 * tau, h // 2), forks), strict=True)
        )
    keep = {r: float(base[r + h - 1]["accuracy"]) for r in forks}
    truth = {
        "stagnation": {r: faster[r] >= keep[r] + args.delta for r in forks},
        "maturity": {r: slower[r] >= keep[r] - args.delta for r in forks},
    }
    scores: dict[str, Any] = {}
    for name in DIAGNOSES:
        values = [float(row[f"diagnosis_{name}"]) for row in base]
        rounds = range(1, len(values) + 1)
        signals = {
            "stagnation": [plateau(values, r, args.window) for r in rounds],
            "maturity": [settled(values, r) for r in rounds],
        }
        scores[name] = {
            event: score(truth[event], {r: signals[event][r - 1] for r in forks}, signals[event])
            for event in truth
        }
    result = {
        "settings": vars(args) | {"out": str(out)},
        "forks": forks,
        "accuracy": {"keep": keep, "faster": faster, "slower": slower},
        "events": {e: [r for r in forks if t[r]] for e, t in truth.items()},
        "scores": scores,
    }
    write_atomic(out / "oracle.json", json.dumps(result, indent=2, default=str) + "\n")
    write_atomic(out / "oracle.md", table(result) + "\n")
    print(table(result))
    print(f"\nwritten to {out}")


def _cell(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(result: dict[str, Any]) -> str:
    """Markdown: oracle events, then each diagnosis's precision / recall / lead time."""
    events = result["events"]
    lines = [
        f"fork rounds {result['forks']}; stagnation at {events['stagnation'] or 'none'}; "
        f"maturity at {events['maturity'] or 'none'}",
        "",
        "| diagnosis | stagnation P | R | lead (rounds) | maturity P | R | lead (rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, by_event in result["scores"].items():
        cells = [name]
        for event in ("stagnation", "maturity"):
            s = by_event[event]
            cells += [_cell(s["precision"]), _cell(s["recall"]), _cell(s["lead_rounds"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
