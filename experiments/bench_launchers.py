"""A preset's sweep on Hydra's basic launcher vs its joblib launcher, side by side.

Both arms run the same `fl-run -m` command (the same arms, seeds and outputs); only
`hydra/launcher` differs. The arms alternate (basic, joblib, basic, ...) so a change in
the machine's load hits both; each repeat records the load average before and after, and
the numbers are checked identical arm for arm (wall-clock fields aside).

    python experiments/bench_launchers.py --repeats 3 -- experiment=apf_vs_fedavg rounds=100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fl.common.files import write_atomic

REPO = Path(__file__).resolve().parent.parent
LAUNCHERS = {
    "basic": [],
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs={jobs}"],
}


def _metrics(sweep_dir: Path) -> dict[str, list[dict]]:
    out = {}
    for job in sorted(p for p in sweep_dir.iterdir() if p.name.isdigit()):
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        out[job.name] = [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]
    return out


def _sweep(overrides: list[str], launcher: list[str], sweep_dir: Path) -> float:
    command = [sys.executable, "-m", "fl.run", "-m", *overrides, *launcher]
    command += [f"hydra.sweep.dir={sweep_dir}", "progress=false", "plots=false"]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="joblib's n_jobs")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("overrides", nargs="+", help="the sweep (after --)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    loads: list[tuple[float, float]] = []
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, launcher in LAUNCHERS.items():
                before = os.getloadavg()[0]
                sweep_dir = Path(tmp) / f"{name}-{repeat}"
                extra = [a.format(jobs=args.jobs) for a in launcher]
                times[name].append(_sweep(args.overrides, extra, sweep_dir))
                loads.append((before, os.getloadavg()[0]))
                metrics = _metrics(sweep_dir)
                if reference is None:
                    reference = metrics
                assert metrics == reference, f"{name} repeat {repeat}: numbers differ"
                print(f"{name} repeat {repeat}: {times[name][-1]:.1f} s, load {before:.2f}")
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "command": " ".join(args.overrides),
        "arms": len(reference or {}),
        "cores": os.cpu_count(),
        "jobs": args.jobs,
        "wall_s": times,
        "median_s": medians,
        "basic_over_joblib": medians["basic"] / medians["joblib"],
        "load_1min_before_after": loads,
        "identical_numbers": True,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
