"""Headroom for the sync-tuning, APF, FedSU and grafting presets (issue 18).

Before a comparison can show anything, the quantity the algorithm improves must have room
on the task. Two measurements, both on plain FedAvg:

``sync [--link MBPS] [--times T,T,...] DIR [DIR ...]`` (GIFT, PAS): reads finished runs
(run or sweep directories) and, per setting (task, partition, lr, clients, links), prints
each arm's accuracy at virtual times up to the budget (the smallest budget among the
setting's runs, or the shortest run), at equal rounds and at equal local steps, mean ± std
and min–max over seeds. Headroom = the best fixed period's accuracy minus FedAvg's at the
longest period, at equal virtual time: the most a period-tuning algorithm can win there.
``--link MBPS`` re-times the fixed-period FedAvg runs as if every link ran at MBPS each way
(other arms are left out): FedAvg's model trajectory per round does not depend on the
clock, and on identical devices in a sync round only the transfer time changes, so this is
exact (checked: a run on 0.2 Mbit/s repeats a 0.05 Mbit/s run's accuracies round by round).

``stable OVERRIDE ...`` (APF, FedSU): runs FedAvg with the given overrides (a preset, say
``experiment=fedsu``), keeps every round's global model and replays on it the two
stability tests with the strategies' own code (`fl.mechanisms.diagnosis`): APF's effective
perturbation P = |EMA(Δ)| / EMA(|Δ|) (α 0.99) below T_s = 0.05, and FedSU's oscillation
ratio R of the second differences (θ 0.99) below T_R = 0.01, and FedSU's whole law (R in,
error checks with T_S = 1 out; `speculated_shares`), which R alone overstates: R passes a
random walk as often as a line. Headroom = the share of scalars each test calls stable (or
the law keeps speculated), averaged over the rounds: the payload an ideal freezer (or
speculator) could skip, judged on FedAvg's trajectory.

    .venv/bin/python experiments/headroom_sync.py sync experiments/out/headroom_sync/*
    .venv/bin/python experiments/headroom_sync.py sync --link 0.2 --times 150,300 \
        experiments/out/headroom_sync/
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

from fl.common.files import write_atomic
from fl.mechanisms.diagnosis import LinearityTest, OscillationRatio, SteppingRate
from fl.mechanisms.speculation import Speculation, error_feedback

APF_THRESHOLD = 0.05  # T_s, APF's default (S-APF-J §VII-A)
FEDSU_THRESHOLD = 0.01  # T_R, FedSU's default (§VI-A)
FEDSU_ERROR_THRESHOLD = 1.0  # T_S, FedSU's default (§VI-A)
EMA = 0.99  # APF's α and the spec's FedSU θ
MILESTONES = (10, 50, 100, 300, 1000)
TIMES = (300, 600, 1000)  # virtual seconds, besides the budget, where sync tables look


# --- sync: fixed periods at equal virtual time, rounds and local steps -------------------


Runs = list[tuple[dict[str, Any], list[dict[str, Any]]]]


def _retimed(cfg: dict[str, Any], rows: list[dict[str, Any]], mbps: float) -> list[dict[str, Any]]:
    """`rows` with round and virtual times as if every link ran at `mbps` each way.

    Exact for fixed-period FedAvg with every client per round on identical devices and
    links and no shared server link: a round is the same compute plus one download and one
    upload of the same bytes, and nothing the model does depends on the clock."""
    system = cfg["system"]
    if (
        cfg["strategy"]["name"] != "fedavg"
        or system["speed_spread"] != 1.0
        or system["bandwidth_spread"] != 1.0
        or system["server_bandwidth_mbps"] is not None
        or cfg["clients_per_round"] != cfg["num_clients"]
    ):
        raise ValueError("re-timing is exact only for FedAvg, full participation, identical links")

    def transfer(row: dict[str, Any], up: float, down: float) -> float:
        per_client = 8e-6 / row["clients"]
        return per_client * (row["bytes_up"] / up + row["bytes_down"] / down)

    clock, out = 0.0, []
    for row in rows:
        old = transfer(row, system["up_mbps"], system["down_mbps"])
        seconds = row["round_time_s"] - old + transfer(row, mbps, mbps)
        clock += seconds
        out.append({**row, "round_time_s": seconds, "virtual_time_s": clock})
    return out


def _relinked(runs: Runs, mbps: float) -> Runs:
    """The fixed-period FedAvg runs of `runs`, re-timed for `mbps` links, with that link in
    their config (so the setting names it) and their budget kept in virtual seconds."""
    out = []
    for cfg, rows in runs:
        if cfg["strategy"]["name"] == "fedavg":
            system = {**cfg["system"], "up_mbps": mbps, "down_mbps": mbps}
            out.append(({**cfg, "system": system}, _retimed(cfg, rows, mbps)))
    return out


def _runs(paths: Sequence[Path]) -> Runs:
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
    part, system = dict(cfg["partition"]), cfg["system"]
    scheme = part.pop("scheme")
    detail = {
        "dirichlet": f"α={part.get('alpha')}",
        "shards": f"{part.get('classes_per_client')}/client",
    }
    return (
        f"{cfg['task']['name']}, {scheme} {detail.get(scheme, '')}, lr {cfg['lr']}, "
        f"{cfg['num_clients']} clients ({cfg['clients_per_round']}/round), "
        f"{system['name']} {system['up_mbps']:g}/{system['down_mbps']:g} Mbit/s"
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


def _in_budget(rows: list[dict[str, Any]], budget: float) -> int:
    """Rounds that ended by the virtual-time budget (a run stops after passing it)."""
    return sum(r["virtual_time_s"] <= budget for r in rows)


def _times(budget: float, times: Sequence[float] = TIMES) -> list[float]:
    return [t for t in times if t < budget] + [budget]


def _arm_cells(arm: str, runs: Runs, times: Sequence[float], rounds: int, steps: int) -> list[str]:
    """One table row: accuracy at the virtual `times` (the last is the budget), at equal
    rounds, at equal local steps."""
    return [
        arm,
        ",".join(str(c["seed"]) for c, _ in runs),
        *(_cell([_accuracy(r, "virtual_time_s", t) for _, r in runs]) for t in times),
        f"{statistics.mean(_in_budget(r, times[-1]) for _, r in runs):.0f}",
        _cell([_accuracy(r, "round", rounds) for _, r in runs]),
        _cell([_accuracy(r, "round", steps, c["local_steps"]) for c, r in runs])
        if arm.startswith("FedAvg")
        else "- (τ varies)",
    ]


def _headroom(fixed: dict[str, Runs], times: Sequence[float]) -> str:
    """Best fixed period minus the longest at each time: per arm the mean paired difference
    over the seeds it shares with the longest period, with their min–max."""
    longest = max(fixed, key=lambda arm: fixed[arm][0][0]["local_steps"])
    reference = {c["seed"]: r for c, r in fixed[longest]}
    parts = []
    for t in times:
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


def sync_table(
    paths: Sequence[Path], link: float | None = None, times: Sequence[float] = TIMES
) -> str:
    """One Markdown table per setting, and its headroom line; with `link` (Mbit/s), only
    the fixed-period FedAvg runs, re-timed for that link (`_retimed`). A setting's budget is
    the smallest of its runs' budgets, or the virtual time of its shortest run if less."""
    runs = _runs(paths)
    if link is not None:
        runs = _relinked(runs, link)
    settings: dict[str, dict[str, Runs]] = defaultdict(lambda: defaultdict(list))
    for cfg, rows in runs:
        settings[_setting(cfg)][_arm(cfg)].append((cfg, rows))
    out = []
    for setting, arms in settings.items():
        every_run = [(c, r) for runs in arms.values() for c, r in runs]
        budget = min(min(c["time_budget_s"], r[-1]["virtual_time_s"]) for c, r in every_run)
        fixed = {a: runs for a, runs in arms.items() if a.startswith("FedAvg")}
        everything = [(c, r) for runs in (fixed or arms).values() for c, r in runs]
        rounds = min(_in_budget(r, budget) for _, r in everything)
        steps = min(c["local_steps"] * _in_budget(r, budget) for c, r in everything)
        at = _times(budget, times)
        head = ["arm", "seeds", *(f"acc @ {t:g} s" for t in at), "rounds in budget"]
        head += [f"acc @ round {rounds}", f"acc @ {steps} local steps"]
        lines = [f"**{setting}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        order = sorted(arms, key=lambda a: (a not in fixed, arms[a][0][0]["local_steps"], a))
        for arm in order:
            cells = _arm_cells(arm, arms[arm], at, rounds, steps)
            lines.append("| " + " | ".join(cells) + " |")
        if fixed:
            lines += ["", _headroom(fixed, at)]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _sync_args(argv: list[str]) -> tuple[list[Path], float | None, tuple[float, ...]]:
    """`[--link MBPS] [--times T,T,...] DIR ...` as (directories, link, times)."""
    paths, link, times = [], None, TIMES
    args = iter(argv)
    for arg in args:
        if arg == "--link":
            link = float(next(args))
        elif arg == "--times":
            times = tuple(float(t) for t in next(args).split(","))
        else:
            paths.append(Path(arg))
    return paths, link, times


# --- stable: APF's and FedSU's stable shares along FedAvg's trajectory -------------------


def stable_shares(history: Sequence[torch.Tensor]) -> dict[str, list[float]]:
    """Per round (from the second on), the share of scalars that APF's test (P < T_s) and
    FedSU's (R < T_R) call stable, each test fed every scalar's global round update, and
    the share FedSU's whole law would keep speculated (`speculated_shares`)."""
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
    return shares | {"fedsu_law": speculated_shares(history)}


def speculated_shares(history: Sequence[torch.Tensor]) -> list[float]:
    """Per round, the share of scalars FedSU's law keeps speculated along FedAvg's path.

    The strategy's own pieces (`fl.mechanisms.speculation`): a regular scalar enters when R < T_R,
    with its last round update as slope; at the checks after 1, 2, 3, ... rounds its phase
    error is what FedAvg's clients would report had it been speculated, FedAvg's value now
    minus the speculated one (full participation), and it leaves when that reaches T_S
    slopes. So R's stable share is narrowed to the scalars whose path a line predicts.
    """
    spec = Speculation.fresh(history[0])
    linearity = LinearityTest.fresh(history[0].numel(), EMA)
    shares = []
    for tick, (before, after) in enumerate(itertools.pairwise(history)):
        error = torch.where(spec.speculating, after - spec.values(tick + 1), 0.0)
        _, leave = error_feedback(spec, tick, error, FEDSU_ERROR_THRESHOLD)
        spec.stop(leave, after)
        linearity.reset(leave, spec.slope)
        update = after - before
        regular = ~spec.speculating
        enter = regular & (linearity.update(update, regular) < FEDSU_THRESHOLD)
        spec.track(after)
        spec.start(enter, after, update, tick + 1)
        shares.append(float(spec.speculating.float().mean()))
    return shares


def stable_table(shares: dict[str, list[float]], window: dict[str, float]) -> str:
    """Markdown: the stable share at milestones and averaged over the run."""
    n = len(shares["apf"])
    marks = [m for m in MILESTONES if m <= n] + ([n] if n not in MILESTONES else [])
    head = ["test", *[f"round {m + 1}" for m in marks], f"mean over rounds 2–{n + 1}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = {
        "apf": f"APF: P < {APF_THRESHOLD}",
        "fedsu": f"FedSU: R < {FEDSU_THRESHOLD}",
        "fedsu_law": f"FedSU's law (R < {FEDSU_THRESHOLD} in, S ≥ {FEDSU_ERROR_THRESHOLD} out)",
    }
    for key, series in shares.items():
        cells = [f"{series[m - 1]:.3f}" for m in marks] + [f"**{statistics.mean(series):.3f}**"]
        lines.append("| " + " | ".join([names[key], *cells]) + " |")
    lines += ["", "Window form over the last rounds (`apf_stability_probe.report`):"]
    lines += [f"- {k}: {v:.3f}" for k, v in window.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("sync", "stable"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "sync":
        print(sync_table(*_sync_args(argv[1:])))
        return 0
    run_recording(argv[1:])
    shares = stable_shares(HISTORY)
    window = report(HISTORY, min(100, len(HISTORY) - 1), APF_THRESHOLD)
    print(stable_table(shares, window))
    out = Path("experiments/out/headroom_stable")
    out.mkdir(parents=True, exist_ok=True)
    name = "_".join(a.replace("/", "-") for a in argv[1:])[:120]
    write_atomic(
        out / f"{name}.json", json.dumps({"overrides": argv[1:], **shares, "window": window})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
