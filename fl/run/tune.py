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
from fl.common.files import make_dir, open_for_append, read_regular_text, write_atomic
from fl.run.compare import compare_runs, find_runs

__all__ = ["Tuning", "main"]

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
    report = yaml.safe_load(read_regular_text(best))
    chosen = report.get("overrides") if isinstance(report, dict) else None
    # a study's folder is data: what it chose is taken only as values of the tuned keys
    if not isinstance(chosen, list) or not all(
        isinstance(o, str) and o.partition("=")[0] in spec.space and "=" in o for o in chosen
    ):
        raise SystemExit(f"fl.run.tune: {best}: not a report of a study over {list(spec.space)}")
    return report


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
    run_dirs = [d for arm in spec.arms for d in find_runs(out / "final" / arm)]
    title = str(cfg.get("experiment_title") or out.name)
    print(compare_runs(run_dirs, out, title, plots=bool(cfg.get("plots", True))))
    print(f"fl.run.tune: tuning.md and comparison.md written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
