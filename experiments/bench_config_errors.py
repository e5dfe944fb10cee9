"""How long `fl-run` takes to refuse a bad command line: this checkout against a reference.

Each case is a typo or a bad value a user makes; each is run `--repeats` times per checkout
(alternating, so load drifts hit both alike) and the median wall time from process start to
exit is printed, with the machine's load average before and after. The reference is another
checkout of the project (e.g. the main branch's worktree), run with the same interpreter.

    python experiments/bench_config_errors.py --reference /work/main --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CASES = {
    "typo in a strategy key": ["strategy=fedprox", "strategy.muu=0.1"],
    "unknown strategy": ["strategy=fedavgg"],
    "bad top-level value": ["seed=abc"],
    "bad system value": ["system.speed=inf"],
    "bad strategy value": ["strategy=fedprox", "strategy.mu=abc"],
    "loop the strategy refuses": ["loop=semi_async", "strategy=apf"],
}


def _time_once(checkout: Path, overrides: list[str], run_dir: Path) -> tuple[float, str]:
    """Wall seconds of one refused `python -m fl.run`, and its last stderr line."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "fl.run", f"hydra.run.dir={run_dir}", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    if proc.returncode == 0:
        raise SystemExit(f"{checkout}: {' '.join(overrides)} was not refused")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return elapsed, (lines[-1] if lines else "")


def main() -> None:
    """Print one row per case: median seconds here and in the reference."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="another checkout")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}  cores: {os.cpu_count()}")
    print(f"{'case':28} {'reference s':>12} {'this s':>8}  first line here")
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CASES.items():
            times: dict[str, list[float]] = {"reference": [], "this": []}
            line = ""
            for _ in range(args.repeats):
                times["reference"].append(_time_once(args.reference, overrides, Path(tmp, "r"))[0])
                seconds, line = _time_once(HERE, overrides, Path(tmp, "t"))
                times["this"].append(seconds)
            ref, this = (statistics.median(times[k]) for k in ("reference", "this"))
            print(f"{name:28} {ref:12.2f} {this:8.2f}  {line[:90]}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
