"""CPU seconds of the cohort arm's run (`bench_many_clients.py`): this checkout against a
reference, in interleaved pairs.

A start-up cut of ~0.1 CPU s hides in the spread of a few repeats on a shared VM; pairs run
back to back (the order alternating, so load drifts hit both alike) and the paired median
difference show it. Each run is the cohort arm's whole `fl-run` process (1000 clients × 3
rounds), its CPU seconds (user + system) read from `os.wait4`; the reference is another
checkout of the project, run with the same interpreter.

    python experiments/bench_cohort_pairs.py --reference /work/main --pairs 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_many_clients import OFFLINE_ENV, arm_command

HERE = Path(__file__).resolve().parents[1]


def cpu_seconds(checkout: Path, clients: int, rounds: int) -> float:
    """User + system CPU seconds of one cohort-arm run of `checkout`; exits if it fails."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-pairs-"))
    command = arm_command("cohort", clients, rounds, scratch / "r.json", scratch / "run")
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(checkout)}
    before = _children_cpu()
    try:
        proc = subprocess.run(command, cwd=checkout, env=env, capture_output=True, timeout=600)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: rc={proc.returncode}: {proc.stderr.decode()[-2000:]}")
    return _children_cpu() - before


def _children_cpu() -> float:
    """CPU seconds of this process's waited-for children so far."""
    times = os.times()
    return times.children_user + times.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="another checkout")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    checkouts = {"reference": args.reference.resolve(), "this": HERE}
    seconds: dict[str, list[float]] = {"reference": [], "this": []}
    print(f"load average before: {os.getloadavg()}  cores: {os.cpu_count()}")
    for pair in range(args.pairs):
        order = ("reference", "this") if pair % 2 == 0 else ("this", "reference")
        for name in order:
            seconds[name].append(cpu_seconds(checkouts[name], args.clients, args.rounds))
        reference, this = seconds["reference"][-1], seconds["this"][-1]
        print(f"pair {pair}: reference {reference:.3f} s, this {this:.3f} s")
    differences = [t - r for t, r in zip(seconds["this"], seconds["reference"], strict=True)]
    print(f"load average after: {os.getloadavg()}")
    print(
        f"median CPU s: reference {statistics.median(seconds['reference']):.3f}, "
        f"this {statistics.median(seconds['this']):.3f}; "
        f"paired median difference {statistics.median(differences):+.3f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
