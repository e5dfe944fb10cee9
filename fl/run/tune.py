"""`python -m fl.run.tune experiment=NAME`: a comparison whose every arm is tuned alike.

A preset with a `tuning:` block names its arms, one search space and one trial budget.
For each arm, an Optuna study (`hydra/sweeper=optuna`) tunes that space on a validation
split held out of the train data (`evaluate_on=validation`), never the test split; then
every arm runs with its best trial's values over the preset's seeds on the test split,
and one comparison of all of them is written. So no method is compared against an
untuned baseline: each gets the same grid, the same number of trials and the same seed.

Everything lands under `--out` (default `multirun/tune-NAME/DATE_TIME`): `tune/ARM/` (the
study's trials, its SQLite file, `best.yaml`), `final/ARM/` (the seeded runs),
`tuning.md` (each arm's trials and choice) and `comparison.md`. Rerunning the same command
with the same `--out` resumes: finished studies and runs are not run again.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from fl.common.config import ConfigError, compose, plain
from fl.common.errors import RunError
from fl.common.files import make_dir, open_for_append, read_regular_text, write_atomic
from fl.run.compare import compare_runs
from fl.run.sweep import launched_runs

__all__ = ["Tuning", "check_report", "main"]

BEST = "best.yaml"  # hydra_plugins.adaptive_fl.optuna_sweeper.BEST (not imported: a plugin)


class Tuning:
    """A preset's `tuning:` block, checked: arms, search space, budget, seeds."""

    def __init__(self, block: Any, experiment: str) -> None:
        where = f"experiment={experiment}: tuning"
        if not isinstance(block, dict):
            raise ConfigError(
                f"{where}: the preset has no tuning block (see conf/experiment/*_tuned.yaml)"
            )
        arms, space = block.get("arms"), block.get("space")
        if (
            not isinstance(arms, dict)
            or not arms
            or not all(
                isinstance(v, list) and all(isinstance(o, str) for o in v) for v in arms.values()
            )
        ):
            raise ConfigError(f"{where}.arms: a mapping of arm name to its overrides")
        if not isinstance(space, dict) or not space:
            raise ConfigError(
                f"{where}.space: a mapping of key to Hydra sweep, e.g. lr: choice(0.1,0.3)"
            )
        self.arms: dict[str, list[str]] = arms
        self.space: dict[str, str] = {str(k): str(v) for k, v in space.items()}
        self.trials = _positive(block.get("trials"), f"{where}.trials")
        seeds = block.get("seeds")
        if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
            raise ConfigError(f"{where}.seeds: a list of seeds for the tuned runs")
        self.seeds: list[int] = seeds
        self.sampler = str(block.get("sampler", "grid"))
        self.objective = str(block.get("objective", "final_accuracy"))
        self.direction = str(block.get("direction", "maximize"))
        self.study_seed = int(block.get("study_seed", 0))


def _positive(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}: an integer >= 1")
    return value


def _fl_run(arguments: Sequence[str], log: Path) -> None:
    """One `fl-run -m` in a child process (its own Hydra, its own launcher); output to `log`."""
    command = [sys.executable, "-m", "fl.run", "-m", *arguments]
    make_dir(log.parent)
    with open_for_append(log) as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"fl.run.tune: {' '.join(command)} failed; see {log}")


def _parallel(jobs: int, *, study: bool) -> list[str]:
    if jobs <= 1:
        return []
    launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"]
    return [*launcher, f"hydra.sweeper.n_jobs={jobs}"] if study else launcher


def tune_arm(spec: Tuning, common: list[str], arm: str, out: Path, jobs: int) -> dict[str, Any]:
    """Run (or resume) `arm`'s study; its best trial, as `best.yaml` records it."""
    study_dir = out / "tune" / arm
    best = study_dir / BEST
    if not best.exists():
        _fl_run(
            [
                *common,
                *spec.arms[arm],
                "evaluate_on=validation",
                "hydra/sweeper=optuna",
                f"hydra.sweeper.n_trials={spec.trials}",
                f"hydra.sweeper.sampler={spec.sampler}",
                f"hydra.sweeper.seed={spec.study_seed}",
                f"hydra.sweeper.objective={spec.objective}",
                f"hydra.sweeper.direction={spec.direction}",
                *(f"{k}={v}" for k, v in spec.space.items()),
                *_parallel(jobs, study=True),
                f"hydra.sweep.dir={study_dir}",
                "resume=true",
            ],
            out / "logs" / f"tune-{arm}.log",
        )
    try:
        return check_report(yaml.safe_load(read_regular_text(best)), spec.space)
    except (RunError, OSError, ValueError, yaml.YAMLError) as err:
        raise SystemExit(f"fl.run.tune: {best}: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def check_report(report: Any, space: dict[str, str]) -> dict[str, Any]:
    """A study's `best.yaml`, checked as data: a finite `value` and one `KEY=VALUE` per
    searched key, each a single plain value inside that key's search space (one of a
    choice or range, within an interval); never sweep syntax (`range(...)`, `a,b`), never
    another key. ValueError saying what is wrong."""
    if not isinstance(report, dict):
        raise ValueError(f"not a report of a study over {list(space)}")
    value = report.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"value: {value!r} is not a finite number")
    chosen = report.get("overrides")
    if not isinstance(chosen, list) or not all(isinstance(o, str) for o in chosen):
        raise ValueError(f"overrides: not a list of KEY=VALUE over {list(space)}")
    keys = [o.partition("=")[0] for o in chosen]
    if sorted(keys) != sorted(space):
        raise ValueError(f"overrides: {chosen} do not set each of {list(space)} once")
    for override in chosen:
        key, _, text = override.partition("=")
        if not _in_space(key, text, space[key]):
            raise ValueError(f"overrides: {override!r} is not a value of {key}={space[key]}")
    return report


def _in_space(key: str, text: str, sweep: str) -> bool:
    """Whether `text` is one plain value of `key`'s search space `sweep`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep, RangeSweep
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    try:
        picked = parser.parse_overrides([f"{key}={text}"])[0]
        searched = parser.parse_overrides([f"{key}={sweep}"])[0]
    except HydraException:
        return False
    value: Any = picked.value()
    if picked.is_sweep_override() or not isinstance(value, int | float | str | bool):
        return False
    space = searched.value()
    if isinstance(space, IntervalSweep | RangeSweep):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(space, IntervalSweep):
            return _bound(space.start) <= value <= _bound(space.end)
        start, stop, step = _bound(space.start), _bound(space.stop), _bound(space.step)
        inside = start <= value < stop if step > 0 else stop < value <= start
        steps = (value - start) / step
        return inside and math.isclose(steps, round(steps))
    options = list(searched.sweep_iterator()) if searched.is_sweep_override() else [space]
    return any(type(o) is type(value) and o == value for o in options)


def _bound(number: object) -> float:
    """A bound of a parsed range or interval (Hydra types them Optional)."""
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise ValueError(f"the search space has a bound that is no number: {number!r}")
    return float(number)


def run_tuned(
    spec: Tuning, common: list[str], arm: str, chosen: list[str], out: Path, jobs: int
) -> None:
    """`arm` with its tuned values over the seeds, on the test split (resumes what ran)."""
    seeds = ",".join(str(s) for s in spec.seeds)
    _fl_run(
        [
            *common,
            *spec.arms[arm],
            *chosen,
            f"seed={seeds}",
            *_parallel(jobs, study=False),
            f"hydra.sweep.dir={out / 'final' / arm}",
            "resume=true",
        ],
        out / "logs" / f"final-{arm}.log",
    )


def _tuning_table(spec: Tuning, reports: dict[str, dict[str, Any]], out: Path) -> str:
    """Each arm's study: its trials' values per setting, and the one chosen."""
    import optuna

    lines = [
        f"Each arm: {spec.trials} trials ({spec.sampler} sampler, seed {spec.study_seed}) over "
        f"{', '.join(f'{k}={v}' for k, v in spec.space.items())}; objective {spec.objective} "
        f"({spec.direction}) on the validation split.",
        "",
        "| arm | trial settings → objective | chosen |",
        "|---|---|---|",
    ]
    for arm, report in reports.items():
        storage = f"sqlite:///{(out / 'tune' / arm / 'optuna.db').resolve()}"
        study = optuna.load_study(study_name="fl", storage=storage)
        done = sorted((t for t in study.trials if t.value is not None), key=lambda t: str(t.params))
        cells = "; ".join(
            f"{' '.join(f'{k}={v}' for k, v in t.params.items())} → {t.value:.4f}" for t in done
        )
        lines.append(f"| {arm} | {cells} | {' '.join(report['overrides'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Tune every arm of a preset alike, run the tuned arms over its seeds, compare them."""
    parser = argparse.ArgumentParser(
        prog="python -m fl.run.tune", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "overrides",
        nargs="+",
        help="experiment=NAME (a preset with a tuning block), then any overrides",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default multirun/tune-NAME/DATE_TIME); the same folder resumes",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once, through Hydra's joblib launcher (default 1)",
    )
    args = parser.parse_args(argv)
    experiments = [o.split("=", 1)[1] for o in args.overrides if o.startswith("experiment=")]
    if len(experiments) != 1:
        parser.error("give exactly one experiment=NAME")
    try:
        cfg = compose(list(args.overrides))
        block = cfg.get("tuning")
        spec = Tuning(plain(block) if isinstance(block, DictConfig) else block, experiments[0])
    except ConfigError as err:
        raise SystemExit(f"fl.run.tune: {err}") from None
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or Path("multirun") / f"tune-{experiments[0]}" / stamp).resolve()
    common = [*args.overrides, "tuning=null"]  # the children are plain sweeps
    reports = {}
    for arm in spec.arms:
        print(
            f"fl.run.tune: tuning {arm} ({spec.trials} trials) in {out / 'tune' / arm}", flush=True
        )
        reports[arm] = tune_arm(spec, common, arm, out, args.jobs)
        print(
            f"fl.run.tune: {arm}: {' '.join(reports[arm]['overrides'])} "
            f"({spec.objective} {reports[arm]['value']:.4f} on validation)",
            flush=True,
        )
    for arm, report in reports.items():
        print(f"fl.run.tune: {arm} tuned, seeds {spec.seeds}, in {out / 'final' / arm}", flush=True)
        run_tuned(spec, common, arm, report["overrides"], out, args.jobs)
    write_atomic(out / "tuning.md", _tuning_table(spec, reports, out))
    run_dirs = [d for arm in spec.arms for d in launched_runs(out / "final" / arm)]
    title = str(cfg.get("experiment_title") or out.name)
    print(compare_runs(run_dirs, out, title, plots=bool(cfg.get("plots", True))))
    print(f"fl.run.tune: tuning.md and comparison.md written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
