"""Headroom of the time-side presets (issue 18): FedCA, ASFL, R2SP, LB-BSP, 2D-LRD.

Before a comparison can show that an algorithm saves time, the baseline must waste some.
This script measures how much, on the baseline arm of each preset's finished sweep, and
prints one table per preset: the headroom, then every arm's figures as mean ± sample std
over the seeds found.

Headroom, per preset (all on the baseline arm, all virtual time of `fl/world/clock.py`):

- FedCA, ASFL, LB-BSP: the *barrier idle share* of a synchronous round,
  1 − Σ_r mean_i min(t_i, T_r) / Σ_r T_r, where t_i is selected client i's round trip
  (download, compute, upload) and T_r the round's close. A client cut off at the close
  counts as busy for the whole round. Σ_r mean_i min(t_i, T_r) is an *ideal zero-idle
  clock*: the round's client-seconds spread so that every client finishes together
  (what a perfect load balancer would reach with the same work and the same progress per
  round: an upper bound on what any of these algorithms can save).
  The per-client t_i are not logged, so they are replayed: each round's jobs are put on a
  fresh `VirtualClock` built from the run's own `config.yaml` at the round's logged start,
  with the run's seeded client selection (`FlStrategy.select`), the samples the client
  trains (its shuffled batches) and the model's bytes both ways. The replayed close
  (slowest, k-th arrival, or the deadline) is checked against the logged `round_time_s`.
- R2SP: the *server-link headroom* of a BSP round, 1 − T_link / T_r with
  T_link = max(bytes down, bytes up) / link bandwidth: the shortest cycle a full-duplex
  link allows for the same traffic when compute overlaps other groups' transfers.
- 2D-LRD (equal rounds, no clock): the accuracy a constant learning rate leaves on the
  table at the end, best accuracy seen minus the mean of the last 20 rounds (what a
  late decay could at most keep), and the same in test loss.

Also per time-side preset: the baseline's virtual time to the target accuracy on its own
clock and on the ideal one (ratio = the largest time-to-target cut the preset allows).

    python -m experiments.headroom_time fedca DIR [DIR ...]
    python -m experiments.headroom_time {asfl,r2sp,lbbsp,lrd2d} DIR [DIR ...]
    python -m experiments.headroom_time fedca DIR [DIR ...] --setting system.speed_spread=20

Each DIR is a sweep (numbered job directories) or a run directory; runs of several sweeps
with the same overrides but `seed=` are averaged.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from experiments.asfl_table import _cell
from experiments.lbbsp_table import _reached
from experiments.r2sp_table import _time_to
from fl.common.config import plain
from fl.run.compare import Run, find_runs, load_run
from fl.run.intervals import interval
from fl.world.clock import MBIT, Job, clock_from_config
from fl.world.task import get_task
from server.loop import _deadline_s  # the run's own default deadline, not a copy

__all__ = [
    "PRESETS",
    "RoundReplay",
    "arm_table",
    "headroom_table",
    "idle_headroom",
    "link_headroom",
    "lr_headroom",
    "main",
    "replay",
    "trained_samples",
]

SELECT_SALT = 0x5E1  # FlStrategy.select's stream: np.random.default_rng([seed, round, salt])


@dataclass(frozen=True)
class RoundReplay:
    """One replayed round: its close T (logged) and each selected client's round trip."""

    round: int
    close_s: float
    trips_s: tuple[float, ...]
    replayed_close_s: float  # the close the replay itself predicts

    @property
    def busy_s(self) -> float:
        """Mean client-seconds of the round a client spent working (ideal round length)."""
        return statistics.fmean(min(t, self.close_s) for t in self.trips_s)


def trained_samples(examples: int, batch_size: int, steps: int, epochs: int) -> int:
    """Samples a client trains on: `steps` batches of its epoch-wise shuffle (a short last
    batch per epoch, as clients/trainer.py cuts them), or `epochs` passes."""
    if steps == 0:
        return epochs * examples
    full, rest = divmod(examples, batch_size)
    per_epoch = [batch_size] * full + ([rest] if rest else [])
    epochs_done, left = divmod(steps, len(per_epoch))
    return epochs_done * examples + sum(per_epoch[:left])


def _selected(seed: int, server_round: int, num_clients: int, k: int) -> list[int]:
    """The partitions `FlStrategy.select` draws when every client is a candidate."""
    if k >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, server_round, SELECT_SALT])
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


@cache
def _task_facts(run_dir: Path) -> tuple[Any, Any, dict[str, Any]]:
    """A run's config, task and clock options (`config.yaml`; the task built once)."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    options = plain(cfg.system)
    options.pop("name", None)
    if options.pop("aggregation_s_per_update", 0.0):
        raise ValueError(f"{run_dir}: the replay does not model server aggregation time")
    return cfg, get_task(cfg), options


def _close(trips: Sequence[float], cfg: Any, deadline_s: float) -> float:
    """When a sync round over these trips closes: the k-th arrival, or the deadline."""
    ordered = sorted(trips)
    fraction = cfg.loop.get("first_k_fraction")
    k = len(ordered) if fraction is None else math.ceil(fraction * len(ordered))
    return min(ordered[k - 1], deadline_s)


def replay(run_dir: Path, rows: Sequence[dict[str, Any]]) -> list[RoundReplay]:
    """Every client's round trip in each round of a synchronous run (see module doc)."""
    cfg, task, options = _task_facts(run_dir)
    system = cfg.system
    if (
        cfg.loop.kind != "sync"
        or system.get("availability", 1.0) < 1.0
        or system.get("availability_trace") is not None
    ):
        raise ValueError(f"{run_dir}: the replay covers sync rounds of always-reachable clients")
    sizes, model_bytes = task.sizes, 4 * task.layout.numel  # float32 both ways
    n, k, seed = int(cfg.num_clients), int(cfg.clients_per_round), int(cfg.seed)
    deadline = _deadline_s(cfg, task, clock_from_config(options, n, seed), None)
    out = []
    for row in rows:
        start = row["virtual_time_s"] - row["round_time_s"]
        clock = clock_from_config(options, n, seed)
        clock.now = start
        chosen = _selected(seed, row["round"], n, k)
        for p in chosen:
            batch = min(int(cfg.batch_size), int(sizes[p]))
            samples = trained_samples(int(sizes[p]), batch, cfg.local_steps, cfg.local_epochs)
            clock.submit(Job(p, p, model_bytes, samples, ((1.0, model_bytes),)))
        trips = []
        while (arrival := clock.next_arrival()) is not None:
            trips.append(arrival.arrived_s - start)
        logged = row["round_time_s"]
        out.append(RoundReplay(row["round"], logged, tuple(trips), _close(trips, cfg, deadline)))
    return out


# ----- headroom ----------------------------------------------------------------------------
def _ideal_times(
    rows: Sequence[dict[str, Any]], ideal_round_s: Sequence[float], targets: Sequence[float]
) -> dict[str, float]:
    """Time to each target on the run's clock and on an ideal one where round r takes
    `ideal_round_s[r]` (the same rounds: the same first round at or above the target)."""
    ideal = np.cumsum(ideal_round_s)
    out: dict[str, float] = {}
    for target in targets:
        hit = next((i for i, row in enumerate(rows) if row["accuracy"] >= target), None)
        if hit is not None:
            out[f"ttt_{target:.2f}_s"] = rows[hit]["virtual_time_s"]
            out[f"ttt_{target:.2f}_ideal_s"] = float(ideal[hit])
            out[f"ttt_{target:.2f}_ideal_ratio"] = float(ideal[hit]) / rows[hit]["virtual_time_s"]
    return out


def idle_headroom(
    rounds: Sequence[RoundReplay], rows: Sequence[dict[str, Any]], targets: Sequence[float]
) -> dict[str, Any]:
    """Barrier idle share, and the time to the targets on the ideal zero-idle clock."""
    actual, ideal = sum(r.close_s for r in rounds), sum(r.busy_s for r in rounds)
    return {
        "idle_share": 1.0 - ideal / actual,
        "round_s": actual / len(rounds),
        "ideal_round_s": ideal / len(rounds),
        "replay_max_rel_error": max(abs(r.replayed_close_s / r.close_s - 1) for r in rounds),
        **_ideal_times(rows, [r.busy_s for r in rounds], targets),
    }


def link_headroom(
    run_dir: Path, rows: Sequence[dict[str, Any]], targets: Sequence[float]
) -> dict[str, Any]:
    """BSP round against the full-duplex server link's lower bound for the same bytes,
    and the time to the targets on a clock whose rounds take that bound."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    bandwidth = float(cfg.system.server_bandwidth_mbps) * MBIT  # bytes/s, each direction
    floor = [max(r["bytes_down"], r["bytes_up"]) / bandwidth for r in rows]
    actual = [r["round_time_s"] for r in rows]
    busy = [(r["bytes_down"] + r["bytes_up"]) / bandwidth for r in rows]
    return {
        "link_headroom": 1.0 - sum(floor) / sum(actual),
        "link_busy_share": sum(busy) / (2 * sum(actual)),  # both directions together
        "round_s": statistics.fmean(actual),
        "link_floor_s": statistics.fmean(floor),
        **_ideal_times(rows, floor, targets),
    }


def lr_headroom(rows: Sequence[dict[str, Any]], tail: int = 20) -> dict[str, Any]:
    """What a constant lr leaves at the end: best accuracy (lowest loss) seen against the
    mean of the last `tail` rounds."""
    last = rows[-tail:]
    return {
        "acc_gap": max(r["accuracy"] for r in rows) - statistics.fmean(r["accuracy"] for r in last),
        "loss_gap": statistics.fmean(r["loss"] for r in last) - min(r["loss"] for r in rows),
        "acc_tail_std": statistics.pstdev(r["accuracy"] for r in last),
    }


# ----- arms and metrics ----------------------------------------------------------------------
Rows = list[dict[str, Any]]
Metric = Callable[[Rows, Rows, int], "float | None"]  # (arm's rows, baseline's, groups)


@dataclass(frozen=True)
class Arm:
    """One run: its label (overrides but `seed=` and `experiment=`), seed, rows, directory."""

    label: str
    seed: int
    rows: Rows
    path: Path

    @property
    def groups(self) -> int:
        """R2SP's group count (1 outside loop=groups)."""
        found = [o.split("=", 1)[1] for o in self.label.split() if o.startswith("loop.groups=")]
        return int(found[0]) if found else 1


def load_arms(dirs: Sequence[Path], setting: Sequence[str] = ()) -> list[Arm]:
    """Every finished run under `dirs` (sweeps or run directories); overrides in `setting`
    (a variant of the preset's task that every run shares) are left out of the labels."""
    arms = []
    for path in (p for d in dirs for p in find_runs(d)):
        run: Run = load_run(path)
        shown = (o for o in run.overrides if not o.startswith("seed=") and o not in setting)
        label = " ".join(sorted(shown))
        seed = int(OmegaConf.load(path / "config.yaml").seed)
        arms.append(Arm(label or "(preset defaults)", seed, run.rows, path))
    return arms


def _time(target: float, *, ratio: bool = False) -> Metric:
    """First virtual time the accuracy reaches `target` (r2sp_table's rule), or its ratio to
    the baseline's."""

    def metric(rows: Rows, base: Rows, groups: int) -> float | None:
        mine, theirs = _time_to(rows, target), _time_to(base, target)
        if not ratio:
            return mine
        return None if mine is None or not theirs else mine / theirs

    return metric


def _plateau_time(share: float, *, ratio: bool = False) -> Metric:
    """LB-BSP's rule (lbbsp_table): the first time the 3-round mean accuracy reaches `share`
    of the baseline's plateau (its last-10-round mean), or its ratio to the baseline's."""

    def metric(rows: Rows, base: Rows, groups: int) -> float | None:
        level = share * statistics.fmean(r["accuracy"] for r in base[-10:])
        mine, theirs = _reached(rows, level), _reached(base, level)
        if mine is None or (ratio and theirs is None):
            return None
        return mine["virtual_time_s"] / (theirs["virtual_time_s"] if ratio else 1.0)

    return metric


def _objective(rows: Rows, base: Rows, groups: int, rho: float = 0.5) -> float:
    """ASFL's latency–accuracy objective (asfl_table): ρ·Acc − (1−ρ)·L / L_FedAvg."""
    time_share = rows[-1]["virtual_time_s"] / base[-1]["virtual_time_s"]
    return rho * rows[-1]["accuracy"] - (1 - rho) * time_share


def _mean(key: str, last: int = 0) -> Metric:
    return lambda rows, base, groups: statistics.fmean(r[key] for r in rows[-last:])


def _final(key: str) -> Metric:
    return lambda rows, base, groups: rows[-1][key]


def _best_accuracy(rows: Rows, base: Rows, groups: int) -> float:
    return max(r["accuracy"] for r in rows)


def _cycle_s(rows: Rows, base: Rows, groups: int) -> float:
    """Virtual seconds per cycle (every group once), as r2sp_table counts it."""
    return rows[-1]["virtual_time_s"] * groups / len(rows)


# ----- presets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """What a preset's headroom is and which figures its comparison reports."""

    baseline: str  # the baseline arm's label
    headroom: str  # idle | link | lr
    columns: tuple[tuple[str, Metric, int], ...]  # header, metric, digits
    targets: tuple[float, ...] = ()


PRESETS: dict[str, Preset] = {
    "fedca": Preset(
        "strategy=fedavg",
        "idle",
        (
            ("time to 0.85 (s)", _time(0.85), 2),
            ("÷ FedAvg", _time(0.85, ratio=True), 2),
            ("÷ FedAvg to 0.90", _time(0.90, ratio=True), 2),
            ("÷ FedAvg to 0.93", _time(0.93, ratio=True), 2),
            ("mean round (s)", _mean("round_time_s"), 4),
            ("acc, mean of last 10", _mean("accuracy", 10), 4),
        ),
        (0.85, 0.90, 0.93),
    ),
    "asfl": Preset(
        "+experiment/asfl_arm=fedavg",
        "idle",
        (
            ("objective O (ρ 0.5)", _objective, 3),
            ("time to 0.90 (s)", _time(0.90), 1),
            ("÷ FedAvg", _time(0.90, ratio=True), 2),
            ("virtual time (s)", _final("virtual_time_s"), 1),
            ("final acc", _final("accuracy"), 3),
        ),
        (0.90,),
    ),
    "r2sp": Preset(
        "loop.groups=1 strategy=fedavg",
        "link",
        (
            ("time to 0.90 (s)", _time(0.90), 1),
            ("÷ BSP", _time(0.90, ratio=True), 2),
            ("time to 0.94 (s)", _time(0.94), 1),
            ("÷ BSP", _time(0.94, ratio=True), 2),
            ("s per cycle", _cycle_s, 2),
            ("final acc", _final("accuracy"), 3),
        ),
        (0.90, 0.94),
    ),
    "lbbsp": Preset(
        "strategy.predictor=none strategy.weight_by=samples",
        "idle",
        (
            ("round (s)", _mean("round_time_s"), 3),
            ("barrier wait (s)", _mean("idle_mean_s"), 3),
            ("time to 95 % (s)", _plateau_time(0.95), 1),
            ("÷ BSP", _plateau_time(0.95, ratio=True), 2),
            ("time to 98 % (s)", _plateau_time(0.98), 1),
            ("÷ BSP", _plateau_time(0.98, ratio=True), 2),
            ("acc, mean of last 10", _mean("accuracy", 10), 3),
        ),
    ),
    "lrd2d": Preset(
        "strategy.axes=none",
        "lr",
        (
            ("final acc", _final("accuracy"), 4),
            ("best acc", _best_accuracy, 4),
            ("acc, mean of last 20", _mean("accuracy", 20), 4),
            ("final loss", _final("loss"), 4),
        ),
    ),
}


def headroom(preset: Preset, base: Arm) -> dict[str, Any]:
    """The preset's headroom figures on one baseline run."""
    if preset.headroom == "link":
        return link_headroom(base.path, base.rows, preset.targets)
    if preset.headroom == "lr":
        return lr_headroom(base.rows)
    out = idle_headroom(replay(base.path, base.rows), base.rows, preset.targets)
    if "idle_mean_s" in base.rows[0]:  # LB-BSP logs its own barrier wait: a cross-check
        logged = sum(r["idle_mean_s"] for r in base.rows)
        out["logged_wait_share"] = logged / sum(r["round_time_s"] for r in base.rows)
    return out


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def headroom_table(preset: Preset, arms: Sequence[Arm]) -> str:
    """One line per headroom figure: mean ± std over the baseline's seeds, then each seed."""
    bases = sorted((a for a in arms if a.label == preset.baseline), key=lambda a: a.seed)
    if not bases:
        raise SystemExit(f"no baseline runs ({preset.baseline}) among {len(arms)} runs")
    figures = [headroom(preset, b) for b in bases]
    keys = [k for k in figures[0] if all(k in f for f in figures)]
    seeds = ", ".join(str(b.seed) for b in bases)
    lines = [_row(["headroom figure", f"mean ± std ({len(bases)} seeds)", f"seeds {seeds}"])]
    lines.append("|---|---|---|")
    for key in keys:
        values = [float(f[key]) for f in figures]
        digits = 2 if abs(values[0]) < 1e-3 else 4
        each = " / ".join(f"{v:.{digits}g}" if digits == 2 else f"{v:.4f}" for v in values)
        lines.append(_row([key, _cell(values, 4), each]))
    return "\n".join(lines)


def arm_table(preset: Preset, arms: Sequence[Arm]) -> str:
    """One line per arm: each column's mean ± std over the seeds that arm ran."""
    bases = {a.seed: a for a in arms if a.label == preset.baseline}
    by_label: dict[str, list[Arm]] = defaultdict(list)
    for arm in arms:
        if arm.seed in bases:
            by_label[arm.label].append(arm)
    order = sorted(by_label, key=lambda label: (label != preset.baseline, label))
    head = ["arm", "seeds", *(c[0] for c in preset.columns)]
    lines = [_row(head), "|" + "---|" * len(head)]
    for label in order:
        members = sorted(by_label[label], key=lambda a: a.seed)
        cells = [label, ",".join(str(a.seed) for a in members)]
        for header, metric, digits in preset.columns:
            values = [metric(a.rows, bases[a.seed].rows, a.groups) for a in members]
            cell = _cell([math.nan if v is None else float(v) for v in values], digits)
            if len(values) > 1 and header.startswith("÷"):  # ratios: each seed's too
                cell += " (" + " / ".join("–" if v is None else f"{v:.2f}" for v in values) + ")"
            cells.append(cell)
        lines.append(_row(cells))
    return "\n".join(lines)


LRD2D_TAIL = 20  # the scoreboard's 2D-LRD figure: accuracy, mean of the last 20 rounds


def paired_tail_table(arms: Sequence[Arm], reference: str = "strategy.axes=both") -> str:
    """2D-LRD minus each other arm in points of last-20-round accuracy, paired seed by seed,
    mean [95 % t-interval] and each seed's difference (the figure of records/lrd2d.json)."""
    tail = {
        (a.label, a.seed): statistics.fmean(r["accuracy"] for r in a.rows[-LRD2D_TAIL:])
        for a in arms
    }
    seeds = sorted(s for label, s in tail if label == reference)
    lines = [_row([f"{reference} minus", "seeds", "mean [95 % CI], points", "each seed"])]
    lines.append("|---|---|---|---|")
    for other in sorted({label for label, _ in tail} - {reference}):
        paired = [s for s in seeds if (other, s) in tail]
        diffs = [100 * (tail[(reference, s)] - tail[(other, s)]) for s in paired]
        if len(diffs) < 2:
            continue
        mean, lo, hi = interval(diffs)
        each = " / ".join(f"{d:+.2f}" for d in diffs)
        lines.append(_row([other, str(len(diffs)), f"{mean:+.2f} [{lo:+.2f}, {hi:+.2f}]", each]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the headroom table and the seed-averaged comparison of one preset's sweeps."""
    parser = argparse.ArgumentParser(prog="python -m experiments.headroom_time")
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR")
    parser.add_argument(
        "--setting",
        nargs="*",
        default=(),
        metavar="OVERRIDE",
        help="overrides every run shares (the preset on another task), e.g. system.speed_spread=20",
    )
    args = parser.parse_args(argv)
    preset, arms = PRESETS[args.preset], load_arms(args.dirs, args.setting)
    if not arms:
        print("experiments.headroom_time: no finished runs found", file=sys.stderr)
        return 2
    print(f"### {args.preset}: headroom on the baseline ({preset.baseline})\n")
    print(headroom_table(preset, arms))
    print(f"\n### {args.preset}: comparison (mean ± sample std over seeds)\n")
    print(arm_table(preset, arms))
    if args.preset == "lrd2d":
        print(f"\n### lrd2d: paired accuracy, mean of the last {LRD2D_TAIL} rounds\n")
        print(paired_tail_table(arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
