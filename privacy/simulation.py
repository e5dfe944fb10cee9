"""The DPBalance paper's scheduling study (§VI) in shape: devices, blocks, analysts, pipelines.

Every scheduler sees the same generated workload and runs against its own SQLite
ledger, so every grant passes the ledger's budget checks. Per round we record each
competing analyst's utility U_i (Eq. 7); efficiency (Eq. 8) and fairness (Eq. 9) are
computed from those afterwards, for any β.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from privacy.dpbalance import (
    Pipeline,
    Scheduler,
    dominant_fairness,
    make_scheduler,
    round_utilities,
)
from privacy.ledger import Ledger

__all__ = ["RoundRecord", "Workload", "compare", "generate", "simulate", "summarize"]


@dataclass(frozen=True)
class Workload:
    """The §VI setup; the defaults are the paper's numbers."""

    devices: int = 100
    rounds: int = 10
    period_s: float = 10.0
    blocks_per_round: int = 2  # new blocks per device per period
    budget: tuple[float, float] = (1.0, 1.5)  # per-device ε budget ~ U(a, b)
    analysts: int = 6
    pipelines_per_analyst: int = 25
    mice_fraction: float = 0.75
    mice_epsilon: tuple[float, float] = (0.005, 0.015)
    elephant_epsilon: tuple[float, float] = (0.095, 0.105)
    many_blocks_probability: float = 0.25  # wants the latest 10 blocks, else the latest 1
    many_blocks: int = 10
    all_devices_probability: float = 0.5  # an analyst targets all devices, else 20 %
    subset_fraction: float = 0.2
    seed: int = 0


@dataclass(frozen=True)
class _Arrival:
    time: float
    pipeline: Pipeline


@dataclass
class RoundRecord:
    """What one scheduling round did."""

    round: int
    utilities: dict[str, float]
    served: int
    kappa_sum: float
    waiting: int


@dataclass
class _Generated:
    budgets: list[float]
    arrivals: list[_Arrival] = field(default_factory=list)


def _block(device: int, index: int) -> str:
    return f"d{device:03d}/b{index:03d}"


def generate(w: Workload) -> _Generated:
    """Device budgets and the arrival-ordered pipelines with their block demands.

    Arrivals are a Poisson process conditioned on its count (uniform times over the run);
    pipelines are shuffled across analysts, 25 each; an analyst's device scope (all, or a
    fixed random 20 %) is drawn once per analyst [R]. A pipeline demands its ε on the
    latest 1 or 10 blocks of every device in scope at its arrival.
    """
    rng = np.random.default_rng(w.seed)
    gen = _Generated([float(b) for b in rng.uniform(*w.budget, size=w.devices)])
    scopes = []
    for _ in range(w.analysts):
        if rng.random() < w.all_devices_probability:
            scopes.append(list(range(w.devices)))
        else:
            size = max(1, round(w.subset_fraction * w.devices))
            scopes.append(sorted(rng.choice(w.devices, size=size, replace=False).tolist()))
    total = w.analysts * w.pipelines_per_analyst
    owners = rng.permutation(np.repeat(np.arange(w.analysts), w.pipelines_per_analyst))
    times = np.sort(rng.uniform(0, w.rounds * w.period_s, size=total))
    for j, (t, owner) in enumerate(zip(times, owners, strict=True)):
        mice = rng.random() < w.mice_fraction
        epsilon = float(rng.uniform(*(w.mice_epsilon if mice else w.elephant_epsilon)))
        latest = w.many_blocks if rng.random() < w.many_blocks_probability else 1
        created = (int(t // w.period_s) + 1) * w.blocks_per_round  # blocks per device so far
        indices = range(max(0, created - latest), created)
        demand = {_block(d, i): epsilon for d in scopes[owner] for i in indices}
        pipeline = Pipeline(f"p{j:03d}", f"analyst{owner}", demand, float(t))
        gen.arrivals.append(_Arrival(float(t), pipeline))
    return gen


def simulate(
    scheduler: Scheduler, w: Workload, ledger_path: Path | None = None, *, t0: float | None = None
) -> list[RoundRecord]:
    """Run the workload through `scheduler` on a fresh ledger; one record per round."""
    gen = generate(w)
    t0 = w.period_s if t0 is None else t0
    with tempfile.TemporaryDirectory() as tmp:
        path = ledger_path or Path(tmp) / "ledger.sqlite"
        path.unlink(missing_ok=True)
        records = []
        with Ledger(path) as ledger:
            pending = list(gen.arrivals)
            for r in range(w.rounds):
                start, end = r * w.period_s, (r + 1) * w.period_s
                first = r * w.blocks_per_round
                ledger.add_blocks(
                    {
                        _block(d, i): gen.budgets[d]
                        for d in range(w.devices)
                        for i in range(first, first + w.blocks_per_round)
                    },
                    now=start,
                )
                while pending and pending[0].time < end:
                    ledger.submit(pending.pop(0).pipeline)
                problem = ledger.problem(end)
                grants = ledger.schedule(scheduler, end)
                records.append(
                    RoundRecord(
                        r + 1,
                        round_utilities(problem, grants, t0),
                        len(grants),
                        sum(g.kappa for g in grants),
                        len(problem.pipelines),
                    )
                )
            problems = ledger.check()
            if problems:
                raise AssertionError(f"ledger inconsistent after {scheduler.name}: {problems}")
    return records


def _jain(values: list[float]) -> float:
    u = np.asarray(values, dtype=float)
    if u.size == 0 or float(np.sum(u * u)) == 0:
        return math.nan
    return float(u.sum() ** 2 / (u.size * np.sum(u * u)))


def summarize(records: list[RoundRecord], beta: float) -> dict[str, Any]:
    """Cumulative efficiency (Σ_rounds Σ_i U_i), fairness (Σ_rounds f_β), Jain, served."""
    efficiency = [sum(r.utilities.values()) for r in records]
    fairness = [dominant_fairness(list(r.utilities.values()), beta) for r in records]
    jain = [_jain(list(r.utilities.values())) for r in records]
    return {
        "efficiency": float(sum(efficiency)),
        "fairness": float(np.nansum(fairness)),
        "jain": float(np.nanmean(jain)) if any(not math.isnan(j) for j in jain) else math.nan,
        "served": sum(r.served for r in records),
        "kappa_sum": float(sum(r.kappa_sum for r in records)),
        "round_efficiency": efficiency,
        "round_fairness": fairness,
    }


def _gain(ours: float, theirs: float, beta: float, fairness: bool) -> float:
    """How many times better ours is; for β > 1 fairness is negative and closer to 0 wins."""
    if fairness and beta > 1:
        return theirs / ours if ours != 0 else math.inf
    return ours / theirs if theirs != 0 else math.inf


def compare(
    w: Workload,
    betas: tuple[float, ...] = (0.5, 2.2, 5.0),
    *,
    dpf_n: int = 100,
    kappa_max: float | None = None,
    sweep: tuple[float, ...] = (0.0, 0.5, 1.0, 2.2, 3.5, 5.0),
) -> dict[str, Any]:
    """DPBalance at each β against DPF, DPK and FCFS, plus a β sweep of DPBalance."""

    def dpbalance(beta: float) -> Scheduler:
        return make_scheduler("dpbalance", beta=beta, t0=w.period_s, kappa_max=kappa_max)

    baselines = {
        name: simulate(make_scheduler(name, n=dpf_n), w) for name in ("dpf", "dpk", "fcfs")
    }
    ours = {b: simulate(dpbalance(b), w) for b in betas}
    table = []
    for beta in betas:
        mine = summarize(ours[beta], beta)
        row: dict[str, Any] = {"beta": beta, "dpbalance": mine}
        for name, recs in baselines.items():
            theirs = summarize(recs, beta)
            row[name] = theirs
            row[f"efficiency_gain_vs_{name}"] = _gain(
                mine["efficiency"], theirs["efficiency"], beta, False
            )
            row[f"fairness_gain_vs_{name}"] = _gain(
                mine["fairness"], theirs["fairness"], beta, True
            )
        table.append(row)
    trade_off = []
    for beta in sweep:
        recs = ours[beta] if beta in ours else simulate(dpbalance(beta), w)
        s = summarize(recs, beta)
        trade_off.append({"beta": beta, "efficiency": s["efficiency"], "jain": s["jain"]})
    return {
        "workload": w.__dict__,
        "dpf_n": dpf_n,
        "kappa_max": kappa_max,
        "table": table,
        "trade_off": trade_off,
    }
