"""Per-round wall time of each issue-35 room preset's arms on this machine (issue 35).

Runs each arm given (a preset and the overrides that pick one arm and seed of its sweep,
`hydra.mode=RUN`) for `--rounds` rounds in a fresh process, one after another, and reports
the median and mean of each arm's per-round wall times after round 1 (round 1 carries
start-up; the mean also counts the test passes of runs that set `evaluate_every` > 1),
the virtual seconds a round (for presets whose runs end at a virtual-time budget), and the
machine's 1-minute load before and after each arm. Nothing here is timed inside a
process: the rounds' `wall_time_s` in metrics.jsonl are what a user's run would show.

    .venv/bin/python experiments/time_room_presets.py --rounds 4 \\
        --json experiments/out/room_timing.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fl.common.files import write_atomic
from fl.run.tracking import evaluated

ROOT = Path(__file__).resolve().parent.parent

# (label, overrides): one arm and seed of each room preset's sweep
ARMS: list[tuple[str, list[str]]] = [
    ("apf_room fedavg", ["experiment=apf_room", "strategy=fedavg"]),
    ("apf_room apf", ["experiment=apf_room", "strategy=apf"]),
    ("pas_room fedavg", ["experiment=pas_room", "strategy=fedavg"]),
    ("pas_room pas", ["experiment=pas_room", "strategy=pas"]),
    ("gift_room gift", ["experiment=gift_room", "strategy=gift"]),
    ("fedsu_room fedavg", ["experiment=fedsu_room", "strategy=fedavg"]),
    ("fedsu_room fedsu", ["experiment=fedsu_room", "strategy=fedsu"]),
    ("fedca_room fedavg", ["experiment=fedca_room", "strategy=fedavg"]),
    ("fedca_room fedca", ["experiment=fedca_room", "strategy=fedca"]),
    ("lrd2d_room both", ["experiment=lrd2d_room", "strategy.axes=both"]),
    ("asfl_room fedavg", ["experiment=asfl_room", "+experiment/asfl_arm=fedavg"]),
    ("asfl_room asfl", ["experiment=asfl_room", "+experiment/asfl_arm=asfl"]),
    ("r2sp_room bsp", ["experiment=r2sp_room", "loop.groups=1", "strategy=fedavg"]),
    ("r2sp_room r2sp", ["experiment=r2sp_room", "loop.groups=16", "strategy=r2sp"]),
    ("lbbsp_room narx", ["experiment=lbbsp_room", "strategy.predictor=narx"]),
    ("grafting_room fedavg", ["experiment=grafting_room", "strategy=fedavg"]),
    ("grafting_room graft_apf", ["experiment=grafting_room", "strategy=graft_apf"]),
    ("dpbalance_room", ["experiment=dpbalance_room"]),
]


def time_arm(
    overrides: list[str], rounds: int, extra: list[str], code: Path = ROOT
) -> dict[str, Any]:
    """One arm's run of `rounds` rounds of the checkout `code`: per-round wall and virtual
    seconds, load."""
    env = dict(os.environ, PYTHONPATH=str(code), FLWR_TELEMETRY_ENABLED="0")
    env |= {"FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        args = [*overrides, "hydra.mode=RUN", "seed=0", f"rounds={rounds}", "plots=false"]
        args += [f"hydra.run.dir={tmp}/run", *extra]
        load = [os.getloadavg()[0]]
        done = subprocess.run(
            [sys.executable, "-m", "fl.run", *args],
            cwd=code,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        load.append(os.getloadavg()[0])
        if done.returncode:
            return {"error": done.stderr[-2000:], "load1": load}
        rows = [
            json.loads(line) for line in Path(tmp, "run/metrics.jsonl").read_text().splitlines()
        ]
        log = Path(tmp, "run/run.log").read_text()
    walls = [r["wall_time_s"] for r in rows]
    per_round = [b - a for a, b in itertools.pairwise(walls)]
    cohort = [line.split("] - ", 1)[-1] for line in log.splitlines() if "local engine:" in line]
    return {
        "round_s": statistics.median(per_round) if per_round else None,
        # the mean, which counts the evaluated rounds' test pass at its share (evaluate_every)
        "mean_round_s": statistics.fmean(per_round) if per_round else None,
        "round_s_all": per_round,
        "first_round_s": walls[0] if walls else None,
        "virtual_s_per_round": rows[-1]["virtual_time_s"] / len(rows) if rows else None,
        "rounds_done": len(rows),
        "accuracy": [r["accuracy"] for r in evaluated(rows)],
        "engine": cohort[:1],
        "load1": load,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--only", nargs="*", help="labels (prefixes) of the arms to time")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for every arm")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout to run (a reference)")
    args = parser.parse_args(argv)
    results = {}
    for label, overrides in ARMS:
        if args.only and not any(label.startswith(o) for o in args.only):
            continue
        results[label] = time_arm(overrides, args.rounds, args.extra, args.code.resolve())
        print(label, json.dumps(results[label]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
