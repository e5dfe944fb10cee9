"""Packing the App for a submission: `flwr run` of the checkout vs of `fl-run`'s staged copy.

`fl-run engine=deployment` used to hand the checkout to `flwr run`, which lists and
resolves every file under it (a virtualenv, run outputs) before applying `.gitignore`.
It now stages the App's files (`fl.run.engines.deployment.staged_app`) and hands over the copy.
This times both ways of building the FAB that `flwr run` submits, alternating, and checks
the bytes are the same:

    .venv/bin/python experiments/bench_submit.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl.run.engines.deployment import REPO, staged_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    files = sum(len(names) for _, _, names in os.walk(REPO))
    checkout, staged = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        reference = build_fab_from_disk(REPO)
        checkout.append(time.perf_counter() - start)
        start = time.perf_counter()
        with staged_app() as app:
            fab = build_fab_from_disk(app)
        staged.append(time.perf_counter() - start)
        assert fab == reference, "the staged App packs another FAB"
    a, b = statistics.median(checkout), statistics.median(staged)
    print(f"files under {REPO}: {files}; FAB {len(reference)} B, identical both ways")
    print(f"flwr's build of the checkout: median {a:.3f} s  (min {min(checkout):.3f})")
    print(f"staged copy, then the build:  median {b:.3f} s  (min {min(staged):.3f})")
    print(f"ratio of medians: {a / b:.1f}x; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
