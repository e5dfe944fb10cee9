"""The digits split in a fresh process: scikit-learn's `load_digits` + `train_test_split`
against `fl.world.data.load_dataset("digits")`, which reads the same file and draws the same
split without importing scikit-learn.

Each side runs in its own fresh interpreter, alternately, `--repeats` times. Both first
import NumPy and torch (untimed: every run imports them anyway), then the timed part
loads the digits and splits them 80/20 stratified with the seed, ending with the same four
arrays (checked equal). Printed: each side's median seconds, the ratio, and the load
average before and after.

    .venv/bin/python experiments/bench_digits_start.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRELUDE = "import time, hashlib, numpy as np, torch\nstart = time.perf_counter()\n"
SIDES = {
    "scikit-learn": PRELUDE
    + """from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
bunch = load_digits()
x = (bunch.data / 16.0).astype(np.float32)
arrays = train_test_split(x, bunch.target, test_size=0.2, stratify=bunch.target, random_state=0)
""",
    "fl.world.data": PRELUDE
    + """from fl.world.data import load_dataset
ds = load_dataset("digits", seed=0)
arrays = [t.numpy() for t in (ds.x_train, ds.x_test, ds.y_train, ds.y_test)]
""",
}
EPILOGUE = """elapsed = time.perf_counter() - start
digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).astype(np.float64).tobytes()
                                 for a in arrays)).hexdigest()
print(elapsed, digest)
"""


def _once(code: str) -> tuple[float, str]:
    done = subprocess.run(
        [sys.executable, "-c", code + EPILOGUE],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    seconds, digest = done.stdout.split()
    return float(seconds), digest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()}  cores: {os.cpu_count()}")
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    digests: set[str] = set()
    for _ in range(args.repeats):
        for name, code in SIDES.items():
            seconds, digest = _once(code)
            times[name].append(seconds)
            digests.add(digest)
    if len(digests) != 1:
        raise SystemExit("the two sides gave different arrays")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:>14}: median {median:.3f} s over {args.repeats} fresh processes")
    ratio = medians["scikit-learn"] / medians["fl.world.data"]
    print(f"scikit-learn / fl.world.data: {ratio:.1f}x (same arrays, checked)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
