"""Headroom for the sync-tuning, APF, FedSU and grafting presets (issue 18).

Before a comparison can show anything, the quantity the algorithm improves must have room
on the task. Two measurements, both on plain FedAvg:

``sync DIR [DIR ...]`` (GIFT, PAS): reads finished runs (run or sweep directories) and,
per setting (task, partition, lr, clients, links), prints each arm's accuracy at virtual
times up to the budget (the smallest budget among the setting's runs), at equal rounds
and at equal local steps, mean ± std and min–max over seeds. Headroom = the best fixed
period's accuracy minus FedAvg's at the longest period, at equal virtual time: the most a
period-tuning algorithm can win there.

``stable OVERRIDE ...`` (APF, FedSU): runs FedAvg with the given overrides (a preset, say
``experiment=fedsu``), keeps every round's global model and replays on it the two
stability tests with the strategies' own code (`fl.diagnosis`): APF's effective
perturbation P = |EMA(Δ)| / EMA(|Δ|) (α 0.99) below T_s = 0.05, and FedSU's oscillation
ratio R of the second differences (θ 0.99) below T_R = 0.01. Headroom = the share of
scalars each test calls stable, averaged over the rounds: the payload an ideal freezer (or
speculator) acting on that test each round could skip, judged on FedAvg's trajectory.

    .venv/bin/python experiments/headroom_sync.py sync experiments/out/headroom_sync/*
    .venv/bin/python experiments/headroom_sync.py stable experiment=fedsu \
        output_dir=/tmp/headroom overwrite=true
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from apf_stability_probe import HISTORY, report
from apf_stability_probe import main as run_recording

from fl.diagnosis import OscillationRatio, SteppingRate

APF_THRESHOLD = 0.05  # T_s, APF's default (S-APF-J §VII-A)
FEDSU_THRESHOLD = 0.01  # T_R, FedSU's default (§VI-A)
EMA = 0.99  # APF's α and the spec's FedSU θ
MILESTONES = (10, 50, 100, 300, 1000)
TIMES = (300, 600, 1000)  # virtual seconds, besides the budget, where sync tables look


# --- sync: fixed periods at equal virtual time, rounds and local steps -------------------


def _runs(paths: Sequence[Path]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(config, metrics rows) of every finished run at or under `paths`."""
    found = []
    for path in paths:
        for summary in sorted([path / "summary.json", *path.glob("*/summary.json")]):
            if summary.exists():
                run = summary.parent
                cfg = yaml.safe_load((run / "config.yaml").read_text())
                rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
                found.append((cfg, rows))
    return found


def _setting(cfg: dict[str, Any]) -> str:
    """What the arms of one headroom table share: task, split, lr, clients, links."""
    part = dict(cfg["partition"])
    scheme = part.pop("scheme")
    detail = {
        "dirichlet": f"α={part.get('alpha')}",
        "shards": f"{part.get('classes_per_client')}/client",
    }
    return (
        f"{cfg['task']['name']}, {scheme} {detail.get(scheme, '')}, lr {cfg['lr']}, "
        f"{cfg['num_clients']} clients ({cfg['clients_per_round']}/round), "
        f"{cfg['system']['name']}"
    )


def _arm(cfg: dict[str, Any]) -> str:
    name = cfg["strategy"]["name"]
    return (
        f"FedAvg τ={cfg['local_steps']}"
        if name == "fedavg"
        else f"{name} (τ0={cfg['local_steps']})"
    )


def _accuracy(rows: list[dict[str, Any]], key: str, limit: float, scale: int = 1) -> float | None:
    """Accuracy after the last round whose `key` (times `scale`) is at most `limit`."""
    kept = [r for r in rows if r[key] * scale <= limit]
    return kept[-1]["accuracy"] if kept else None


def _cell(values: Sequence[float | None]) -> str:
    """Percent, mean ± sample std (min–max) over seeds."""
    vals = [100 * v for v in values if v is not None]
    if not vals:
        return "-"
    std = statistics.stdev(vals) if len(vals) > 1 else 0.0
    spread = f" ({min(vals):.2f}–{max(vals):.2f})" if len(vals) > 1 else ""
    return f"{statistics.mean(vals):.2f} ± {std:.2f}{spread}"


Runs = list[tuple[dict[str, Any], list[dict[str, Any]]]]


def _in_budget(rows: list[dict[str, Any]], budget: float) -> int:
    """Rounds that ended by the virtual-time budget (a run stops after passing it)."""
    return sum(r["virtual_time_s"] <= budget for r in rows)


def _times(budget: float) -> list[float]:
    return [t for t in TIMES if t < budget] + [budget]


def _arm_cells(arm: str, runs: Runs, budget: float, rounds: int, steps: int) -> list[str]:
    """One table row: accuracy at virtual times up to the budget, at equal rounds, at
    equal local steps."""
    return [
        arm,
        ",".join(str(c["seed"]) for c, _ in runs),
        *(_cell([_accuracy(r, "virtual_time_s", t) for _, r in runs]) for t in _times(budget)),
        f"{statistics.mean(_in_budget(r, budget) for _, r in runs):.0f}",
        _cell([_accuracy(r, "round", rounds) for _, r in runs]),
        _cell([_accuracy(r, "round", steps, c["local_steps"]) for c, r in runs])
        if arm.startswith("FedAvg")
        else "- (τ varies)",
    ]


def _headroom(fixed: dict[str, Runs], budget: float) -> str:
    """Best fixed period minus the longest at each time: per arm the mean paired difference
    over the seeds it shares with the longest period, with their min–max."""
    longest = max(fixed, key=lambda arm: fixed[arm][0][0]["local_steps"])
    reference = {c["seed"]: r for c, r in fixed[longest]}
    parts = []
    for t in _times(budget):
        gaps = {}
        for arm, runs in fixed.items():
            diffs = [
                100
                * (
                    (_accuracy(r, "virtual_time_s", t) or 0.0)
                    - (_accuracy(reference[c["seed"]], "virtual_time_s", t) or 0.0)
                )
                for c, r in runs
                if c["seed"] in reference
            ]
            if diffs:
                gaps[arm] = diffs
        best = max(gaps, key=lambda arm: statistics.mean(gaps[arm]))
        d = gaps[best]
        parts.append(
            f"@{t:g} s {statistics.mean(d):+.2f} ({best}, {len(d)} seeds, "
            f"{min(d):+.2f} to {max(d):+.2f})"
        )
    return f"Headroom (best fixed minus {longest}, paired by seed): " + ", ".join(parts)


def sync_table(paths: Sequence[Path]) -> str:
    """One Markdown table per setting, and its headroom line."""
    settings: dict[str, dict[str, Runs]] = defaultdict(lambda: defaultdict(list))
    for cfg, rows in _runs(paths):
        settings[_setting(cfg)][_arm(cfg)].append((cfg, rows))
    out = []
    for setting, arms in settings.items():
        budget = min(c["time_budget_s"] for runs in arms.values() for c, _ in runs)
        fixed = {a: runs for a, runs in arms.items() if a.startswith("FedAvg")}
        everything = [(c, r) for runs in (fixed or arms).values() for c, r in runs]
        rounds = min(_in_budget(r, budget) for _, r in everything)
        steps = min(c["local_steps"] * _in_budget(r, budget) for c, r in everything)
        head = ["arm", "seeds", *(f"acc @ {t:g} s" for t in _times(budget)), "rounds in budget"]
        head += [f"acc @ round {rounds}", f"acc @ {steps} local steps"]
        lines = [f"**{setting}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        order = sorted(arms, key=lambda a: (a not in fixed, arms[a][0][0]["local_steps"], a))
        for arm in order:
            cells = _arm_cells(arm, arms[arm], budget, rounds, steps)
            lines.append("| " + " | ".join(cells) + " |")
        if fixed:
            lines += ["", _headroom(fixed, budget)]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


# --- stable: APF's and FedSU's stable shares along FedAvg's trajectory -------------------


def stable_shares(history: Sequence[torch.Tensor]) -> dict[str, list[float]]:
    """Per round (from the second on), the share of scalars that APF's test (P < T_s) and
    FedSU's (R < T_R) call stable, each test fed every scalar's global round update."""
    numel = history[0].numel()
    everywhere = torch.ones(numel, dtype=torch.bool)
    apf, fedsu = SteppingRate.fresh(numel, EMA), OscillationRatio.fresh(numel, EMA)
    shares: dict[str, list[float]] = {"apf": [], "fedsu": []}
    for before, after in itertools.pairwise(history):
        delta = after - before
        p = apf.rate(delta, everywhere)
        r = fedsu.test.update(delta, everywhere)
        shares["apf"].append(float((p < APF_THRESHOLD).float().mean()))
        shares["fedsu"].append(float((r < FEDSU_THRESHOLD).float().mean()))
    return shares


def stable_table(shares: dict[str, list[float]], window: dict[str, float]) -> str:
    """Markdown: the stable share at milestones and averaged over the run."""
    n = len(shares["apf"])
    marks = [m for m in MILESTONES if m <= n] + ([n] if n not in MILESTONES else [])
    head = ["test", *[f"round {m + 1}" for m in marks], f"mean over rounds 2–{n + 1}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = {"apf": f"APF: P < {APF_THRESHOLD}", "fedsu": f"FedSU: R < {FEDSU_THRESHOLD}"}
    for key, series in shares.items():
        cells = [f"{series[m - 1]:.3f}" for m in marks] + [f"**{statistics.mean(series):.3f}**"]
        lines.append("| " + " | ".join([names[key], *cells]) + " |")
    lines += ["", "Window form over the last rounds (`apf_stability_probe.report`):"]
    lines += [f"- {k}: {v:.3f}" for k, v in window.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("sync", "stable"):
        print(__doc__)
        return 2
    if argv[0] == "sync":
        print(sync_table([Path(p) for p in argv[1:]]))
        return 0
    run_recording(argv[1:])
    shares = stable_shares(HISTORY)
    window = report(HISTORY, min(100, len(HISTORY) - 1), APF_THRESHOLD)
    print(stable_table(shares, window))
    out = Path("experiments/out/headroom_stable")
    out.mkdir(parents=True, exist_ok=True)
    name = "_".join(a.replace("/", "-") for a in argv[1:])[:120]
    (out / f"{name}.json").write_text(
        json.dumps({"overrides": argv[1:], **shares, "window": window})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
