"""LB-BSP vs BSP in its three settings (spec algorithms_b.md §3.5): CPU, GPU model, FL.

    python experiments/lbbsp_table.py [--fl SWEEP] [--json OUT] [--iterations 300]
    python experiments/lbbsp_table.py --fl-seeds SWEEP [SWEEP ...]   # FL ratios over seeds

CPU cluster (simulated speeds, real training): 8 workers with speeds v_i = v_max,i·(1 - load)
under an AR(1) background load (ρ = 0.9) with bursts; CPU and memory usage (load plus
noise) are read before each iteration. Predictors (last value, EMA(0.5), NARX) forecast
each worker's speed; the mean absolute error is over the same trace. Each iteration's
global batch of X = 256 digits samples is split BSP's way (X/N each) and LB-BSP's way
(∝ predicted speed); the batch-weighted gradient of the per-worker mean gradients is
compared with the full-batch gradient, and both runs train the MLP to compare their
losses. Iteration time is the slowest worker's x_i/v_i (compute-bound).
The same exactness with real processes: `clients.cluster_check.cluster_check` (2 gloo ranks).

GPU cluster (a model, not GPUs): 6 devices of 3 types with time
t_i(x) = max(a_i, b_i·x + c_i)·(1 + 2 % noise) and memory caps; the leader/straggler loop
runs from BSP's split, X = 512.

FL: the sweep of `fl-run experiment=lbbsp` (predictor none = BSP, last, ema, narx; each
weighted by samples B_i·τ or by |D_i|): mean round time and barrier wait, and virtual time
until the accuracy (mean of 3 rounds) first reaches 95 % and 98 % of BSP's plateau (the
batch-weighted BSP arm's mean over its last 10 rounds).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from fl.common.config import compose
from fl.common.files import write_atomic
from fl.mechanisms.lbbsp import LeaderStraggler, make_predictor, proportional_sizes
from fl.world.task import get_task

WORKERS, GLOBAL_BATCH = 8, 256


# ----- CPU cluster -----------------------------------------------------------------------
def load_traces(iterations: int, seed: int = 0) -> np.ndarray:
    """(iterations, workers) background load: AR(1) plus bursts of +0.4 (about every 25
    iterations per worker, lasting ~5), clipped to [0, 0.95]."""
    rng = np.random.default_rng([seed, 0x1B])
    load = np.full(WORKERS, 0.3)
    burst = np.zeros(WORKERS, dtype=int)
    rows = []
    for _ in range(iterations):
        load = 0.9 * load + 0.1 * 0.3 + 0.05 * rng.standard_normal(WORKERS)
        start = (burst == 0) & (rng.random(WORKERS) < 0.04)
        burst = np.where(start, rng.geometric(0.2, WORKERS), np.maximum(burst - 1, 0))
        rows.append(np.clip(load + 0.4 * (burst > 0), 0.0, 0.95))
    return np.array(rows)


def cpu_trace(iterations: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Speeds (iterations, workers) in samples/s and the signals (CPU, memory usage)."""
    rng = np.random.default_rng([seed, 0xC9])
    v_max = 2000.0 * np.exp(rng.uniform(-0.35, 0.35, WORKERS))  # a 2x spread of machines
    load = load_traces(iterations, seed)
    speeds = v_max * (1.0 - load)
    cpu = load + 0.02 * rng.standard_normal(load.shape)
    memory = 0.2 + 0.5 * load + 0.02 * rng.standard_normal(load.shape)
    return speeds, np.stack([cpu, memory], axis=-1)


def predictions(name: str, speeds: np.ndarray, signals: np.ndarray) -> np.ndarray:
    """One-step-ahead speed forecasts of every worker (NaN before the first observation)."""
    out = np.full(speeds.shape, math.nan)
    models = [make_predictor(name) for _ in range(WORKERS)]
    for k in range(len(speeds)):
        for i, model in enumerate(models):
            guess = model.predict(signals[k, i].tolist())
            out[k, i] = math.nan if guess is None else guess
            model.observe(float(speeds[k, i]), signals[k, i].tolist())
    return out


def split(guesses: np.ndarray) -> list[int]:
    """LB-BSP's shares of the global batch (BSP's while any guess is missing)."""
    if np.isnan(guesses).any():
        return proportional_sizes([1.0] * WORKERS, GLOBAL_BATCH)
    return proportional_sizes(np.maximum(guesses, 1.0).tolist(), GLOBAL_BATCH)


def _mean_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def train_split(shares: list[list[int]], lr: float = 0.3, seed: int = 0) -> dict[str, Any]:
    """SGD on digits where each iteration's global batch is cut into `shares` and the
    per-worker mean gradients are averaged with weights b_i/X; the full-batch gradient
    of the same samples is computed alongside for the check."""
    task = get_task(compose(["partition=iid", "num_clients=1"]))
    x, y = task.client_data(0)
    torch.manual_seed(seed)
    model = task.new_model()
    generator = torch.Generator().manual_seed(seed)
    order, cursor = torch.randperm(len(y), generator=generator), 0
    worst, losses = 0.0, []
    for cut in shares:
        if cursor + GLOBAL_BATCH > len(y):
            order, cursor = torch.randperm(len(y), generator=generator), 0
        batch = order[cursor : cursor + GLOBAL_BATCH]
        cursor += GLOBAL_BATCH
        weighted = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
        start = 0
        for b in cut:
            part = batch[start : start + b]
            start += b
            weighted += _mean_grads(model, x[part], y[part]).double() * (b / GLOBAL_BATCH)
        full = _mean_grads(model, x[batch], y[batch]).double()
        worst = max(worst, float((weighted - full).abs().max()))
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                p.sub_(weighted[offset : offset + p.numel()].view_as(p).to(p.dtype), alpha=lr)
                offset += p.numel()
            losses.append(float(F.cross_entropy(model(x), y)))
    with torch.no_grad():
        x_test, y_test = task.dataset.x_test, task.dataset.y_test
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    return {"grad_max_abs_diff": worst, "losses": losses, "accuracy": accuracy}


def cpu_variant(iterations: int) -> dict[str, Any]:
    speeds, signals = cpu_trace(iterations)
    bsp = [proportional_sizes([1.0] * WORKERS, GLOBAL_BATCH)] * iterations
    out: dict[str, Any] = {"iterations": iterations, "workers": WORKERS, "X": GLOBAL_BATCH}
    bsp_times = np.array(
        [[b / v for b, v in zip(bsp[k], speeds[k], strict=True)] for k in range(iterations)]
    )
    out["bsp_iteration_s"] = float(bsp_times.max(axis=1).mean())
    out["target_reduction"] = float(1 - (bsp_times.mean(axis=1) / bsp_times.max(axis=1)).mean())
    out["ideal_iteration_s"] = float((GLOBAL_BATCH / speeds.sum(axis=1)).mean())
    warm = 50  # errors and times after every predictor has warmed up (NARX: 20 steps)
    arms: dict[str, Any] = {}
    for name in ("last", "ema", "narx"):
        guess = predictions(name, speeds, signals)
        cuts = [split(guess[k]) for k in range(iterations)]
        times = np.array(
            [max(b / v for b, v in zip(cuts[k], speeds[k], strict=True)) for k in range(iterations)]
        )
        arms[name] = {
            "speed_mae": float(np.abs(guess[warm:] - speeds[warm:]).mean()),
            "relative_mae": float(
                np.abs(guess[warm:] - speeds[warm:]).mean() / speeds[warm:].mean()
            ),
            "iteration_s": float(times[warm:].mean()),
            "reduction": float(1 - times[warm:].mean() / bsp_times.max(axis=1)[warm:].mean()),
            "cuts": cuts,
        }
    out["bsp_iteration_s_after_warmup"] = float(bsp_times.max(axis=1)[warm:].mean())
    base = train_split(bsp)
    narx = train_split(arms["narx"].pop("cuts"))
    for arm in arms.values():
        arm.pop("cuts", None)
    out["predictors"] = arms
    out["bsp_training"] = {k: base[k] for k in ("grad_max_abs_diff", "accuracy")}
    out["lbbsp_training"] = {k: narx[k] for k in ("grad_max_abs_diff", "accuracy")}
    out["loss_max_abs_diff"] = float(np.abs(np.array(base["losses"]) - narx["losses"]).max())
    return out


# ----- GPU model -------------------------------------------------------------------------
GPU_TYPES = {  # a (flat floor, s), b (s per sample), c (s), memory cap (samples)
    "fast": (0.040, 1 / 2400, 0.010, 128),
    "mid": (0.060, 1 / 1200, 0.010, 256),
    "slow": (0.080, 1 / 700, 0.020, 96),
}
GPUS = ("fast", "fast", "mid", "mid", "slow", "slow")
GPU_BATCH = 512


def gpu_time(kind: str, x: int) -> float:
    a, b, c, _ = GPU_TYPES[kind]
    return max(a, b * x + c)


def optimum_s() -> float:
    """The best makespan within the caps (bisection on T: Σ min(cap, (T-c)/b) ≥ X)."""
    low, high = 0.0, 10.0
    for _ in range(100):
        t = (low + high) / 2
        room = sum(
            min(GPU_TYPES[k][3], max(0.0, (t - GPU_TYPES[k][2]) / GPU_TYPES[k][1])) for k in GPUS
        )
        low, high = (t, high) if room < GPU_BATCH else (low, t)
    return high


def gpu_variant(iterations: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng([seed, 0x69])
    caps = [GPU_TYPES[k][3] for k in GPUS]
    loop = LeaderStraggler.even(GPU_BATCH, caps)
    bsp_sizes = list(loop.sizes)
    times, violations, converged = [], 0, None
    for k in range(iterations):
        clean = [gpu_time(kind, x) for kind, x in zip(GPUS, loop.sizes, strict=True)]
        if converged is None and loop.spread(clean) < 0.05:
            converged = k
        noisy = [t * (1 + 0.02 * rng.standard_normal()) for t in clean]
        times.append(max(clean))
        sizes = loop.observe(noisy)
        violations += sum(s > c or s < 1 for s, c in zip(sizes, caps, strict=True))
        assert sum(sizes) == GPU_BATCH
    bsp = max(gpu_time(kind, x) for kind, x in zip(GPUS, bsp_sizes, strict=True))
    bsp_each = [gpu_time(kind, x) for kind, x in zip(GPUS, bsp_sizes, strict=True)]
    tail = float(np.mean(times[-100:]))
    return {
        "gpus": list(GPUS),
        "caps": caps,
        "X": GPU_BATCH,
        "bsp_sizes": bsp_sizes,
        "final_sizes": loop.sizes,
        "bsp_iteration_s": bsp,
        "target_reduction": 1 - float(np.mean(bsp_each)) / bsp,
        "lbbsp_iteration_s_last_100": tail,
        "reduction": 1 - tail / bsp,
        "optimum_s": optimum_s(),
        "iterations_to_spread_below_5pct": converged,
        "moves": loop.moves,
        "final_step": loop.step,
        "final_window": loop.window,
        "cap_violations": violations,
    }


# ----- FL --------------------------------------------------------------------------------
def _arm(job: Path) -> tuple[tuple[str, str], list[dict[str, Any]]]:
    """(predictor, weighting) of a job and its metrics rows."""
    overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    label = (values.get("strategy.predictor", "ema"), values.get("strategy.weight_by", "samples"))
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return label, rows


def _reached(rows: list[dict[str, Any]], level: float) -> dict[str, Any] | None:
    """The first row where the mean accuracy of it and the two before reaches `level`."""
    accuracy = [r["accuracy"] for r in rows]
    return next(
        (rows[k] for k in range(2, len(rows)) if np.mean(accuracy[k - 2 : k + 1]) >= level),
        None,
    )


def fl_variant(sweep: Path | list[Path]) -> dict[str, Any]:
    """The FL table of one seed: a sweep directory, or the job directories of one seed."""
    jobs = (
        sweep if isinstance(sweep, list) else sorted(p for p in sweep.iterdir() if p.name.isdigit())
    )
    arms = dict(_arm(job) for job in jobs)
    reference = ("none", "samples")  # BSP: every client B_0, batch-weighted
    if reference not in arms:
        raise SystemExit(f"{sweep}: no BSP arm (strategy.predictor=none weight_by=samples)")
    plateau = float(np.mean([r["accuracy"] for r in arms[reference][-10:]]))
    out: dict[str, Any] = {"plateau": plateau, "arms": {}}
    for label, rows in arms.items():
        arm: dict[str, Any] = {
            "rounds": len(rows),
            "round_s": float(np.mean([r["round_time_s"] for r in rows])),
            "idle_s": float(np.mean([r["idle_mean_s"] for r in rows])),
            "final_accuracy": float(np.mean([r["accuracy"] for r in rows[-10:]])),
        }
        for share in (0.95, 0.98):
            row = _reached(rows, share * plateau)
            arm[f"time_to_{share:.2f}"] = None if row is None else row["virtual_time_s"]
            arm[f"rounds_to_{share:.2f}"] = None if row is None else row["round"]
        out["arms"][" ".join(label)] = arm
    base = out["arms"][" ".join(reference)]
    for arm in out["arms"].values():
        for key in ("round_s", "idle_s", "time_to_0.95", "time_to_0.98"):
            if arm[key] is not None and base[key]:
                arm[f"{key}_vs_bsp"] = arm[key] / base[key]
    return out


def _seed_of(job: Path) -> int:
    config = yaml.safe_load((job / "config.yaml").read_text())
    return int(config["seed"])


def fl_over_seeds(sweeps: list[Path]) -> str:
    """Each arm's time to 95 % and 98 % of its seed's BSP plateau, as a ratio to that
    seed's BSP, per seed and as the mean with its 95 % t-interval over seeds."""
    from fl.run.intervals import interval

    by_seed: dict[int, list[Path]] = {}
    for sweep in sweeps:
        for job in sorted(p for p in sweep.iterdir() if (p / "summary.json").exists()):
            by_seed.setdefault(_seed_of(job), []).append(job)
    tables = {seed: fl_variant(jobs) for seed, jobs in sorted(by_seed.items())}
    seeds = list(tables)
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; ratios to the same seed's BSP, "
        "mean [95 % t-interval]:",
        "",
        "| arm | time to 95 % vs BSP (per seed) | mean [interval] "
        "| time to 98 % vs BSP | mean [interval] |",
        "|---|---|---|---|---|",
    ]
    for arm in tables[seeds[0]]["arms"]:
        cells = [arm]
        for key in ("time_to_0.95_vs_bsp", "time_to_0.98_vs_bsp"):
            values = [tables[s]["arms"][arm].get(key) for s in seeds]
            known = [v for v in values if v is not None]
            cells.append(" / ".join("—" if v is None else f"{v:.2f}" for v in values))
            if len(known) == len(values) and len(known) > 1:
                mean, low, high = interval(known)
                cells.append(f"{mean:.2f} [{low:.2f}, {high:.2f}]")
            else:
                cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    cpu, gpu = results["cpu"], results["gpu"]
    lines = [
        f"CPU, {cpu['workers']} workers, X = {cpu['X']}, {cpu['iterations']} iterations "
        f"(times and errors after 50): BSP {cpu['bsp_iteration_s_after_warmup'] * 1e3:.1f} ms "
        f"per iteration, ideal X/Σv {cpu['ideal_iteration_s'] * 1e3:.1f} ms, target reduction "
        f"1 - mean(t)/max(t) = {cpu['target_reduction']:.1%}",
        "",
        "| predictor | speed MAE (samples/s) | relative MAE | iteration (ms) | reduction vs BSP |",
        "|---|---|---|---|---|",
    ]
    for name, arm in cpu["predictors"].items():
        lines.append(
            f"| {name} | {arm['speed_mae']:.1f} | {arm['relative_mae']:.1%} | "
            f"{arm['iteration_s'] * 1e3:.1f} | {arm['reduction']:.1%} |"
        )
    lines += [
        "",
        f"Gradient, batch-weighted vs full batch (max over iterations): BSP split "
        f"{cpu['bsp_training']['grad_max_abs_diff']:.1e}, LB-BSP (NARX) split "
        f"{cpu['lbbsp_training']['grad_max_abs_diff']:.1e}; training loss max |diff| "
        f"{cpu['loss_max_abs_diff']:.1e}; test accuracy {cpu['bsp_training']['accuracy']:.4f} "
        f"vs {cpu['lbbsp_training']['accuracy']:.4f}.",
    ]
    if "gloo" in results:
        g = results["gloo"]
        lines.append(
            f"Real processes ({g['ranks']} gloo ranks, shares {g['shares']}): gradient max "
            f"|diff| {g['grad_max_abs_diff']:.1e}, weights after {g['steps']} steps "
            f"{g['weights_max_abs_diff']:.1e}."
        )
    lines += [
        "",
        f"GPU model ({', '.join(gpu['gpus'])}; caps {gpu['caps']}; X = {gpu['X']}): BSP "
        f"{gpu['bsp_iteration_s'] * 1e3:.1f} ms (sizes {gpu['bsp_sizes']}), LB-BSP last 100 "
        f"iterations {gpu['lbbsp_iteration_s_last_100'] * 1e3:.1f} ms (sizes "
        f"{gpu['final_sizes']}): {gpu['reduction']:.1%} less (target "
        f"{gpu['target_reduction']:.1%}; optimum within caps {gpu['optimum_s'] * 1e3:.1f} ms); "
        f"spread < 5 % after {gpu['iterations_to_spread_below_5pct']} iterations, "
        f"{gpu['moves']} moves, Δ {gpu['final_step']}, W {gpu['final_window']}, "
        f"{gpu['cap_violations']} cap violations.",
    ]
    if "fl" in results:
        fl = results["fl"]
        lines += [
            "",
            f"FL (plateau = BSP's last-10-round mean accuracy {fl['plateau']:.3f}):",
            "",
            "| arm | round (s) | barrier wait (s) | rounds to 95 % | time to 95 % | vs BSP "
            "| time to 98 % | vs BSP | final acc |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        names = {"none samples": "BSP", "none examples": "standard FL (BSP, FedAvg weights)"}
        for label, arm in fl["arms"].items():
            predictor, weighting = label.split()
            cells = [
                names.get(label, f"LB-BSP ({predictor}, {weighting}-weighted)"),
                f"{arm['round_s']:.3f}",
                f"{arm['idle_s']:.3f}",
                str(arm["rounds_to_0.95"] or "—"),
            ]
            for key in ("time_to_0.95", "time_to_0.98"):
                value, ratio = arm[key], arm.get(f"{key}_vs_bsp")
                cells += [
                    "—" if value is None else f"{value:.1f}",
                    "—" if ratio is None else f"{ratio:.2f}",
                ]
            cells.append(f"{arm['final_accuracy']:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fl", type=Path, help="the sweep directory of fl-run experiment=lbbsp")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--no-processes", action="store_true", help="skip the gloo check")
    parser.add_argument(
        "--fl-seeds",
        type=Path,
        nargs="+",
        metavar="SWEEP",
        help="only the FL ratios over seeds, from these sweep directories (any seeds)",
    )
    args = parser.parse_args()
    if args.fl_seeds:
        print(fl_over_seeds(args.fl_seeds))
        return
    torch.set_num_threads(1)
    results: dict[str, Any] = {"cpu": cpu_variant(args.iterations), "gpu": gpu_variant(400)}
    if not args.no_processes:
        from clients.cluster_check import cluster_check

        results["gloo"] = cluster_check(2, "gloo", "cpu")
    if args.fl is not None:
        results["fl"] = fl_variant(args.fl)
    if args.json is not None:
        write_atomic(args.json, json.dumps(results, indent=2))
    print(markdown(results))


if __name__ == "__main__":
    main()
