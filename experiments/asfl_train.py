"""ASFL's training protocol (spec algorithms_b.md §1.6): train the agent over short episodes,
then evaluate its greedy policy on held-out seeds against the baselines.

    python experiments/asfl_train.py train OUT [--episodes 150] [--rho 0.5] [--name N --sac K=V]
    python experiments/asfl_train.py evaluate OUT [--seeds 20] [--rho 0.5 [0.2 0.8]]

The spec's setting mapped to our config (ENV below): digits, 50 clients, label-Dirichlet(0.3),
logistic regression (`task.model=logreg`), 30 rounds an episode, a 10 % crash probability
(`faults.crash=0.1`: a selected client's ClientApp raises, each round). Three device-speed
tiers do not exist here; the nearest is `system=heterogeneous` with a 4× log-uniform speed
spread (1×–4×) and uplinks of 0.04–0.4 Mbit/s (the model's 2.6 kB in 0.05–0.5 s, the spec's
upload times). All 50 clients stay in flight (SAFA: every client trains every round), so
K ∈ {5, 10, 15, 25, 50}. Every ASFL arm runs SAFA's full protocol (`resync`, `cfcfm`).

train: episode e runs seed 1000 + e with `policy=sac` and the spec's SAC settings (lr 3e-4,
batch 64, one update a round), the agent carried from episode to episode in
OUT/agent-rhoR.pt (`strategy.agent_file`); OUT/train-rhoR.jsonl gets one line per finished
episode (its objective, accuracy, latency, mean K and τ). Rerunning continues after the
last finished episode (one killed midway resumes from its checkpoint). At the end the
actor is written to OUT/policy-rhoR.pt. `--name N --sac KEY=V ...` trains a variant with
other agent settings into OUT/*-rhoR-N.* (e.g. a larger reward scale).

evaluate: seeds 0 .. n−1 (never trained on). Per seed: FedAvg (sync, all 50), FedBuff
(buffer 10 of 50 in flight), the fixed (K, τ) grid K ∈ {0.1, 0.2, 0.3, 0.5, 1.0}·N ×
τ ∈ {1, 3, 5} on SAFA's protocol (SAFA itself is (0.5, 3)), the random policy, and the
trained policy of each ρ. O = ρ·Acc_final − (1−ρ)·L/L_FedAvg (L: the run's virtual time,
L_FedAvg: FedAvg's on the same seed); only the trained arms (one per policy file in OUT)
depend on ρ. Prints, per ρ and trained arm,
the mean and 95 % t-interval of O per arm, those of ASFL's paired per-seed differences
to each baseline, and a verdict; OUT/eval.jsonl holds one line per finished run (rerunning
skips them). The best fixed point is picked on the evaluation seeds themselves (the
hardest bar for ASFL).

Cost (2-core VM shared with other jobs, 2026-12-04, RESULTS "issue 29"): 1.6 s of CPU an
episode (150 episodes: 4 min), 1.35 s an evaluation run (one seed of 22 arms: 30 s; 20
seeds: 10 min).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
from pathlib import Path
from typing import Any

# torch's AVX-512 kernels round sums unlike its AVX2 ones: figures are AVX2's on any x86
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

ENV = [
    "num_clients=50",
    "clients_per_round=50",
    "task.model=logreg",
    "partition.alpha=0.3",
    "faults.crash=0.1",
    "system=heterogeneous",
    "system.speed_spread=4",
    "system.up_mbps=0.4",
    "system.bandwidth_spread=10",
    "rounds=30",
    "checkpoint_every=10",
    "progress=false",
    "plots=false",
]
SAFA = ["strategy=safa"]  # fixed quota and lag, resync and CFCFM
ASFL = ["strategy=asfl", "strategy.resync=true", "strategy.cfcfm=true"]
SPEC_SAC = ["strategy.lr=0.0003", "strategy.batch_size=64", "strategy.updates_per_round=1"]
TRAIN_SEED = 1000  # episode e trains on seed 1000 + e; evaluation seeds start at 0
GRID = [(q, t) for q in (0.1, 0.2, 0.3, 0.5, 1.0) for t in (1, 3, 5)]
BASELINES = ("fedavg", "fedbuff", "safa")


def _tag(rho: float) -> str:
    return f"rho{rho:g}"


def arms(out: Path) -> dict[str, list[str]]:
    """Every evaluation arm's overrides (besides ENV and the seed): the baselines, and a
    trained arm per policy file in `out`."""
    found = {
        "fedavg": ["strategy=fedavg"],
        "fedbuff": ["strategy=fedbuff", "loop=semi_async", "loop.buffer_k=10"],
        "random": [*ASFL, "strategy.policy=random"],
    }
    for q, t in GRID:
        name = "safa" if (q, t) == (0.5, 3) else f"fixed-{q:g}-{t}"
        found[name] = [*SAFA, f"strategy.fixed_quota={q}", f"strategy.fixed_lag={t}"]
    for policy in sorted(out.glob("policy-*.pt")):
        name = "asfl-" + policy.stem.removeprefix("policy-")
        found[name] = [*ASFL, "strategy.policy=trained", f"strategy.policy_file={policy}"]
    return found


# ----- one run, in this process ----------------------------------------------------------
def run(out: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """The round loop of `fl-run` with these overrides, outputs in `out`, continued from its
    checkpoint where one is; its metrics rows."""
    import clients.app as client
    from fl.common.config import compose, to_run_config
    from fl.run.engines.local import LocalGrid
    from fl.run.validation import validate
    from server.loop import run_training

    cfg = compose([*overrides, f"resume={str(out.exists()).lower()}"])
    validate(cfg)
    run_training(LocalGrid(client.app, cfg.num_clients, to_run_config(cfg)), cfg, out)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _tidy(out: Path) -> None:
    """A finished run, recorded: its checkpoints and model go (metrics stay)."""
    from fl.run.checkpoint import CHECKPOINT, PREVIOUS

    for name in (CHECKPOINT, PREVIOUS, "model.pt"):
        (out / name).unlink(missing_ok=True)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's objective and policy read from its rows."""
    last = rows[-1]
    keys = {"accuracy": last["accuracy"], "virtual_time_s": last["virtual_time_s"]}
    if "quota_k" in last:
        keys["mean_k"] = statistics.fmean(r["quota_k"] for r in rows)
        keys["mean_tau"] = statistics.fmean(r["lag_tolerance"] for r in rows)
    return keys


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


# ----- training ----------------------------------------------------------------------------
def train(out: Path, episodes: int, rho: float, name: str = "", sac: tuple[str, ...] = ()) -> None:
    """Episodes not yet in the log, the agent carried in its file; then the policy file.
    `name`, `sac`: a variant's file suffix and its agent overrides."""
    tag = _tag(rho) + (f"-{name}" if name else "")
    log, agent_file = out / f"train-{tag}.jsonl", out / f"agent-{tag}.pt"
    done = len(_lines(log))
    if done == 0 and agent_file.exists() and not (out / tag / "000").exists():
        raise SystemExit(f"{agent_file} exists but no episode finished: remove it first")
    for episode in range(done, episodes):
        seed, run_dir = TRAIN_SEED + episode, out / tag / f"{episode:03d}"
        learning = ["strategy.policy=sac", f"strategy.agent_file={agent_file}"]
        overrides = [*ENV, *ASFL, *SPEC_SAC, *sac, *learning, f"strategy.preference={rho}"]
        rows = run(run_dir, [*overrides, f"seed={seed}"])
        record = {"episode": episode, "seed": seed, "objective": rows[-1]["objective"]}
        record |= _summary(rows) | {"alpha": rows[-1]["alpha"]}
        _append(log, record)
        _tidy(run_dir)
        print(json.dumps(record), flush=True)
    _save_policy(agent_file, out / f"policy-{tag}.pt", [*ENV, *ASFL, *SPEC_SAC, *sac])


def _save_policy(agent_file: Path, policy_file: Path, overrides: list[str]) -> None:
    """The trained agent's actor, for `policy=trained`."""
    from fl.common.config import compose, plain
    from fl.mechanisms.sac import SACDiscrete
    from fl.strategy.registry import get_strategy

    values = plain(compose(overrides).strategy)
    params = get_strategy("asfl").make_params(values)
    agent = SACDiscrete(params.sac_config(), 0)
    agent.load(agent_file, params.meta)
    agent.save_policy(policy_file, params.meta)


# ----- evaluation --------------------------------------------------------------------------
def evaluate(out: Path, seeds: int, rhos: list[float]) -> str:
    """Every arm on every held-out seed not yet in the log; the report."""
    log = out / "eval.jsonl"
    done = {(r["arm"], r["seed"]) for r in _lines(log)}
    for seed in range(seeds):
        for arm, overrides in arms(out).items():
            if (arm, seed) in done:
                continue
            run_dir = out / "eval" / arm / str(seed)
            rows = run(run_dir, [*ENV, *overrides, f"seed={seed}"])
            _append(log, {"arm": arm, "seed": seed, **_summary(rows)})
            _tidy(run_dir)
    return report(_lines(log), rhos, seeds)


def objectives(records: list[dict[str, Any]], rho: float, seeds: int) -> dict[str, list[float]]:
    """O per arm, in seed order, over the seeds every arm finished."""
    by = {(r["arm"], r["seed"]): r for r in records}
    names = sorted({r["arm"] for r in records})
    kept = [s for s in range(seeds) if all((a, s) in by for a in names)]
    return {
        arm: [
            rho * by[arm, s]["accuracy"]
            - (1 - rho) * by[arm, s]["virtual_time_s"] / by["fedavg", s]["virtual_time_s"]
            for s in kept
        ]
        for arm in names
    }


def _interval(values: list[float]) -> tuple[float, float, float]:
    from fl.run.intervals import interval

    return interval(values)


def _cell(values: list[float]) -> str:
    mean, low, high = _interval(values)
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def verdict(asfl: list[float], best: list[float], others: dict[str, list[float]]) -> str:
    """The claim ASFL ≥ best fixed and ASFL > FedAvg, FedBuff, SAFA, on paired differences:
    'reproduces' when every strict one's interval lies above 0 and the best fixed point's
    does not lie below 0; 'does not reproduce' when any lies below 0; else 'inconclusive'."""
    strict = [_interval([a - b for a, b in zip(asfl, o, strict=True)]) for o in others.values()]
    against_best = _interval([a - b for a, b in zip(asfl, best, strict=True)])
    if any(high < 0 for _, _, high in [*strict, against_best]):
        return "does not reproduce"
    if all(low > 0 for _, low, _ in strict):
        return "reproduces"
    return "inconclusive"


def report(records: list[dict[str, Any]], rhos: list[float], seeds: int) -> str:
    """Per ρ and trained arm: O per arm (mean, 95 % t-interval), ASFL's paired differences,
    the verdict."""
    lines = []
    for rho in rhos:
        values = objectives(records, rho, seeds)
        tag = f"asfl-{_tag(rho)}"
        for name in [a for a in values if a == tag or a.startswith(f"{tag}-")]:
            lines += _table(values, name, rho)
    return "\n".join(lines)


def _table(values: dict[str, list[float]], name: str, rho: float) -> list[str]:
    """One trained arm against every baseline at preference `rho`."""
    fixed = [a for a in values if a == "safa" or a.startswith("fixed-")]
    best = max(fixed, key=lambda a: statistics.fmean(values[a]))
    n = len(values[name])
    lines = [f"{name}: ρ = {rho:g}, {n} held-out seeds; best fixed (K, τ) on them: {best}", ""]
    lines += ["| arm | O: mean [95 % t-interval] | ASFL − arm, paired |", "|---|---|---|"]
    for arm in sorted(values, key=lambda a: -statistics.fmean(values[a])):
        if arm.startswith("asfl-") and arm != name:
            continue
        diff = [a - b for a, b in zip(values[name], values[arm], strict=True)]
        paired = "—" if arm == name else _cell(diff)
        lines.append(f"| {arm} | {_cell(values[arm])} | {paired} |")
    others = {b: values[b] for b in BASELINES}
    return [*lines, "", f"verdict: {verdict(values[name], values[best], others)}", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("train", "evaluate"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--episodes", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--rho", type=float, nargs="+", default=[0.5])
    parser.add_argument("--name", default="", help="train: a variant's file suffix")
    parser.add_argument("--sac", nargs="*", default=[], help="train: the variant's overrides")
    args = parser.parse_args()
    from fl.common.seeding import pin_torch_threads

    pin_torch_threads(1)
    logging.disable(logging.WARNING)  # injected crashes log a warning each: expected here
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "train":
        for rho in args.rho:
            train(args.out, args.episodes, rho, args.name, tuple(args.sac))
    else:
        print(evaluate(args.out, args.seeds, args.rho))


if __name__ == "__main__":
    main()
