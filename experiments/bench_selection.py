"""Per-round selection over a population: array operations vs a Python walk.

`loop=semi_async` and `loop=groups` drop the nodes in flight from the round's candidates
(`RoundDriver.idle`), and ASFL scores and ranks every candidate (`ASFLServer.select`).
This times both on a population of `--clients` nodes with 100 in flight and 1000 heard
from, against the Python walk they replaced (inlined below as the reference), checks that
both give the same nodes, and prints medians and their ratios:

    .venv/bin/python experiments/bench_selection.py --clients 1000000 --repeats 5
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl.run.loops import LoopSettings, RoundDriver
from fl.world.population import PartitionMap
from strategies.asfl import ASFLParams, ASFLServer


def walk_idle(driver: RoundDriver, nodes: Any, groups: int) -> list[int]:
    """The reference: the Python filter `RoundDriver.idle` used to run."""
    if driver.settings.kind != "groups":
        return [n for n in nodes if n not in driver.flights]
    busy = {driver.partitions[n] % groups for n in driver.flights}
    return [n for n in nodes if driver.partitions[n] % groups not in busy]


def walk_select(server: ASFLServer, server_round: int, candidates: Any) -> list[int]:
    """The reference: ASFL's selection by a full Python sort of every candidate."""
    k = min(server.clients_per_round, len(candidates))
    jitter = np.random.default_rng([server.seed, server_round, 0xA5F1]).random(len(candidates))
    listed, seen = list(candidates), server.seen
    known = [seen[n] for n in listed if n in seen]
    loss = float(np.mean([s[0] for s in known])) or 1.0
    examples = float(np.mean([s[1] for s in known])) or 1.0
    duration = float(np.median([s[2] for s in known])) or 1.0
    scores = [
        seen[n][0] / loss + seen[n][1] / examples - seen[n][2] / duration if n in seen else math.inf
        for n in listed
    ]
    best = sorted(range(len(listed)), key=lambda i: (-scores[i], jitter[i]))[:k]
    return [listed[i] for i in sorted(best)]


def timed(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds of `repeats` calls, and the last call's result."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(1, args.clients + 1, dtype=np.uint64) * 7919)
    partitions = PartitionMap(ids)
    nodes = partitions.by_partition
    in_flight = {int(n): None for n in ids[rng.choice(args.clients, 100, replace=False)]}
    rows = []
    for kind in ("semi_async", "groups"):
        driver = RoundDriver(LoopSettings(kind=kind, groups=4), None, partitions, math.inf)  # type: ignore[arg-type]
        driver.flights = in_flight  # type: ignore[assignment]
        ours, got = timed(lambda d=driver: d.idle(nodes), args.repeats)
        walk, ref = timed(lambda d=driver: walk_idle(d, nodes, 4), args.repeats)
        assert list(got) == ref
        rows.append((f"idle, loop={kind}", walk, ours))
    server = ASFLServer(ASFLParams(), seed=0, clients_per_round=100)  # type: ignore[arg-type]
    heard = ids[rng.choice(args.clients, 1000, replace=False)]
    server.seen = {int(n): [float(rng.random()), 60, float(rng.random())] for n in heard}
    server.plan(None)
    ours, got = timed(lambda: server.select(7, nodes), args.repeats)
    walk, ref = timed(lambda: walk_select(server, 7, nodes), args.repeats)
    assert got == ref
    rows.append(("ASFL select", walk, ours))
    load = os.getloadavg()[0]
    print(f"{args.clients} nodes, 100 in flight, 1000 heard from; medians of {args.repeats}")
    print(f"load average {load:.1f}")
    print("| step | Python walk (s) | arrays (s) | ratio |\n|---|---|---|---|")
    for name, walk, ours in rows:
        print(f"| {name} | {walk:.3f} | {ours:.4f} | {walk / ours:.0f}x |")


if __name__ == "__main__":
    main()
