"""Memory soak: RSS of a long many-client `fl-run` (local engine), sampled per round.

The run is a child process (`--child` mode of this script, which calls `fl.run`); a
thread here samples its RSS every `--sample-s` seconds and counts the rows of its
`metrics.jsonl`, so every sample belongs to a round. The child counts live Python
objects by type (gc, objgraph-style) after the warm-up round and near the end, and with
`--tracemalloc` also diffs tracemalloc snapshots by allocation line, so growth can be
traced to its source. Writes `OUT.json` (per-round RSS and the fit) and `OUT.png`.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from fl import OFFLINE_ENV  # telemetry, usage stats and update checks off
from fl.common.files import write_atomic

REPO = Path(__file__).resolve().parent.parent
MB = 2**20


def _rows(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


# ----- child: the run itself, plus in-process object accounting -----------------------------


def _type_counts() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _watch(
    run_dir: Path, marks: tuple[int, int], trace: bool, out: Path, done: threading.Event
) -> None:
    """Record object counts (and tracemalloc snapshots) when the run reaches each mark."""
    import tracemalloc

    metrics = run_dir / "metrics.jsonl"
    taken: list[tuple[collections.Counter[str], Any]] = []
    for mark in marks:
        while _rows(metrics) < mark:
            if done.is_set():  # the run ended before this mark
                return
            time.sleep(0.05)
        snapshot = tracemalloc.take_snapshot() if trace else None
        taken.append((_type_counts(), snapshot))
    (first, snap0), (last, snap1) = taken
    growth = {k: last[k] - first[k] for k in set(first) | set(last) if last[k] != first[k]}
    report: dict[str, Any] = {
        "marks": list(marks),
        "objects": [sum(first.values()), sum(last.values())],
        "type_growth": dict(sorted(growth.items(), key=lambda kv: -abs(kv[1]))[:25]),
    }
    if trace:
        stats = snap1.compare_to(snap0, "lineno")
        report["tracemalloc_top"] = [
            {"where": str(s.traceback), "size_diff_kb": s.size_diff / 1024, "count": s.count_diff}
            for s in stats[:25]
        ]
        report["traced_mb"] = [
            sum(s.size for s in snap.statistics("filename")) / MB for snap in (snap0, snap1)
        ]
    write_atomic(out, json.dumps(report, indent=2) + "\n")


def child(run_dir: Path, marks: tuple[int, int], trace: bool, overrides: list[str]) -> None:
    """Run `fl.run` with `overrides` in this process, watched by `_watch`."""
    if trace:
        import tracemalloc

        tracemalloc.start(1)  # one frame: allocation sites by line, cheap enough
    done = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(run_dir, marks, trace, run_dir / "objects.json", done), daemon=True
    )
    watcher.start()
    from fl.run.cli import main

    sys.argv = ["fl-run", f"hydra.run.dir={run_dir}", "progress=false", *overrides]
    try:
        main()
    finally:
        done.set()
        watcher.join()  # the last snapshot may still be being compared


# ----- parent: launch, sample, summarise ----------------------------------------------------


def sample(cmd: list[str], run_dir: Path, every_s: float) -> tuple[list[dict[str, float]], float]:
    """Run `cmd`; return samples (t, rows done, RSS MB) and the wall time."""
    env = {**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1"}
    log = (run_dir / "child.log").open("wb")
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    ps = psutil.Process(proc.pid)
    samples = []
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss / MB
        except psutil.NoSuchProcess:
            break
        samples.append({"t": time.perf_counter() - started, "rows": _rows(metrics), "rss_mb": rss})
        time.sleep(every_s)
    if proc.wait() != 0:
        tail = (run_dir / "child.log").read_text()[-3000:]
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{tail}")
    return samples, time.perf_counter() - started


def per_round(samples: list[dict[str, float]], rounds: int) -> tuple[list[float], list[float]]:
    """Per round: RSS at its end (first sample after its row) and its floor (lowest sample).

    The floor is the better leak signal: transient buffers raise single samples, a leak
    raises every sample after it.
    """
    end, floor = [], []
    for r in range(1, rounds + 1):
        after = [s["rss_mb"] for s in samples if s["rows"] >= r]
        during = [s["rss_mb"] for s in samples if s["rows"] == r - 1]
        end.append(after[0] if after else float("nan"))
        floor.append(min(during) if during else float("nan"))
    return end, floor


def _slope(y: np.ndarray, first_round: int) -> float:
    x = np.arange(first_round, first_round + len(y), dtype=float)
    ok = np.isfinite(y)
    return float(np.polyfit(x[ok], y[ok], 1)[0] * 100)


def fit(end_rss: list[float], floor: list[float], warmup: int, stop: int) -> dict[str, float]:
    """Trends over rounds warmup+1 .. stop-1 (MB per 100 rounds) and drift of the medians.

    Round `stop` is where the child counts objects (itself an allocation), so the fit
    ends before it; the final round is reported on its own.
    """
    y = np.asarray(end_rss[warmup : stop - 1], dtype=float)
    low = np.asarray(floor[warmup : stop - 1], dtype=float)
    k = max(1, len(y) // 5)
    ok = np.isfinite(y)
    return {
        "slope_mb_per_100_rounds": _slope(y, warmup + 1),
        "floor_slope_mb_per_100_rounds": _slope(low, warmup + 1),
        "median_drift_mb": float(np.nanmedian(y[-k:]) - np.nanmedian(y[:k])),
        "floor_drift_mb": float(np.nanmedian(low[-k:]) - np.nanmedian(low[:k])),
        "rss_after_warmup_mb": float(y[ok][0]),
        "rss_last_mb": float(y[ok][-1]),
        "rss_min_mb": float(y[ok].min()),
        "rss_max_mb": float(y[ok].max()),
        "rss_median_mb": float(np.median(y[ok])),
    }


def plot(
    end_rss: list[float],
    floor: list[float],
    samples: list[dict[str, float]],
    warmup: int,
    out: Path,
) -> None:
    """The whole run, and a zoom on the rounds after warm-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 2]})
    rounds = range(1, len(end_rss) + 1)
    for ax in axes:
        ax.plot(
            [s["rows"] + 0.5 for s in samples],
            [s["rss_mb"] for s in samples],
            ".",
            ms=2,
            alpha=0.25,
            label="samples (0.1 s)",
        )
        ax.plot(rounds, end_rss, "-", lw=1.2, label="end of round")
        ax.plot(rounds, floor, "-", lw=1.2, label="floor of round")
        ax.axvline(warmup, color="grey", ls="--", lw=1, label=f"warm-up ({warmup} rounds)")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    settled = [v for v in end_rss[warmup:] + floor[warmup:] if np.isfinite(v)]
    axes[0].set_ylabel("RSS of the fl-run process (MB)")
    axes[0].set_title("whole run")
    axes[1].set_ylim(min(settled) - 10, max(settled) + 10)
    axes[1].set_xlim(warmup - 5, len(end_rss) + 1)
    axes[1].set_title("after warm-up (zoomed)")
    axes[1].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    write_atomic(out, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def main() -> None:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--sample-s", type=float, default=0.1)
    parser.add_argument("--tracemalloc", action="store_true", help="also diff allocation sites")
    parser.add_argument("--out", type=Path, default=REPO / "experiments/out/memory_soak")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra fl-run overrides")
    args = parser.parse_args()
    marks = (args.warmup, max(args.warmup + 2, args.rounds - 2))
    run = [
        f"num_clients={args.clients}",
        f"clients_per_round={args.per_round}",
        f"rounds={args.rounds}",
        *args.overrides,
    ]
    if args.child is not None:
        child(args.child, marks, args.tracemalloc, run)
        return

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="memory-soak-") as tmp:
        run_dir = Path(tmp)
        cmd = [sys.executable, __file__, "--child", str(run_dir), "--warmup", str(args.warmup)]
        cmd += ["--rounds", str(args.rounds), "--clients", str(args.clients)]
        cmd += [
            "--per-round",
            str(args.per_round),
            *(["--tracemalloc"] if args.tracemalloc else []),
        ]
        samples, wall = sample([*cmd, *args.overrides], run_dir, args.sample_s)
        rss, floor = per_round(samples, args.rounds)
        counted = run_dir / "objects.json"  # absent if the run ended before the marks
        objects = json.loads(counted.read_text()) if counted.exists() else {"objects": None}
        accuracy = json.loads((run_dir / "summary.json").read_text()).get("final_accuracy")
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "overrides": run,
        "wall_s": wall,
        "final_accuracy": accuracy,
        "warmup_rounds": args.warmup,
        "peak_rss_mb": max(s["rss_mb"] for s in samples),
        **fit(rss, floor, args.warmup, marks[1]),
        "rss_final_round_mb": rss[-1],
        "objects": objects,
        "rss_per_round_mb": [round(v, 2) for v in rss],
        "rss_floor_per_round_mb": [round(v, 2) for v in floor],
    }
    write_atomic(args.out.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    plot(rss, floor, samples, args.warmup, args.out.with_suffix(".png"))
    keys = (
        "wall_s",
        "rss_after_warmup_mb",
        "rss_last_mb",
        "slope_mb_per_100_rounds",
        "floor_slope_mb_per_100_rounds",
        "median_drift_mb",
        "floor_drift_mb",
        "peak_rss_mb",
    )
    print(json.dumps({k: result[k] for k in keys} | {"objects": objects["objects"]}, indent=1))


if __name__ == "__main__":
    main()
