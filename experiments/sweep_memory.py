"""A sweep's memory per job: run a sequential multirun (Hydra's basic launcher: every job in
one process, as a joblib worker runs its share) and print the process's RSS as each job
starts. A process that lets each job's data go stays flat from its second job on.

    python experiments/sweep_memory.py experiment=grafting_room strategy=graft_apf \
        seed=0,1,2,3,4 rounds=3 progress=false plots=false
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from fl import OFFLINE_ENV  # telemetry, usage stats and update checks off

REPO = Path(__file__).resolve().parent.parent
JOB_START = "fl-run: run directory "  # fl-run's first line for each job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="+", help="fl-run overrides of a multirun")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds, then killed")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sweep-memory-") as sweep_dir:
        command = [sys.executable, "-m", "fl.run", "-m", *args.overrides]
        command.append(f"hydra.sweep.dir={sweep_dir}")
        env = {**os.environ, **OFFLINE_ENV}
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = threading.Timer(args.timeout, proc.kill)  # the wait's deadline
        deadline.start()
        watched, rss = psutil.Process(proc.pid), []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(JOB_START):
                    rss.append(watched.memory_info().rss / 2**20)
                    print(f"job {len(rss) - 1}: RSS {rss[-1]:7.1f} MB at its start", flush=True)
            code = proc.wait()
        finally:
            deadline.cancel()
    if code != 0:
        print(f"sweep_memory: the sweep exited {code}", file=sys.stderr)
        return 1
    if len(rss) > 2:
        grown = (rss[-1] - rss[1]) / (len(rss) - 2)
        print(f"from job 1 on: {grown:+.1f} MB a job ({time.strftime('%Y-%m-%d %H:%M UTC')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
