"""Hydra sweeper `hydra/sweeper=optuna`: tune a run's hyperparameters with Optuna.

Each trial is one fl-run job; its objective is a key of the run's `summary.json` (the
job's return value), by default `final_accuracy`, which a tuning run measures on a
validation split (`evaluate_on=validation`), never on the test split. The search space is
Hydra's sweep syntax, on the command line or in `hydra.sweeper.params`:
`lr=choice(0.1,0.3)`, `local_epochs=range(1,4)`, `lr=tag(log,interval(0.01,1))`; any
launcher runs the trials (`n_jobs` of them per batch). The study lives in a SQLite file in
the sweep directory, so a killed study resumes where it stopped (same command, same
`hydra.sweep.dir`); the best trial's overrides are written to `best.yaml` beside it.

Why not Hydra's own hydra-optuna-sweeper: it pins optuna<3, whose SQLite storage fails
under the SQLAlchemy 2 that flwr requires. This one keeps to Optuna's public API (ask and
tell with explicit distributions) and Hydra's sweeper interface.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module before
# it is in sys.modules, where a dataclass cannot resolve string annotations.
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from fl.common.files import write_atomic

if TYPE_CHECKING:  # optuna is imported when a sweep starts, not on every fl-run's plugin scan
    import optuna
    from optuna.distributions import BaseDistribution

__all__ = ["BEST", "OptunaSweeper", "OptunaSweeperConf"]

log = logging.getLogger(__name__)
BEST = "best.yaml"
SAMPLERS = ("tpe", "random", "grid")
INTERRUPTED = "interrupted"  # user attribute of a trial a killed study left running


@dataclass
class OptunaSweeperConf:
    """`hydra.sweeper.*` of `hydra/sweeper=optuna`."""

    _target_: str = "hydra_plugins.adaptive_fl.optuna_sweeper.OptunaSweeper"
    n_trials: int = (
        20  # the budget: trials that ran (a killed study's unfinished ones do not count)
    )
    n_jobs: int = 1  # trials handed to the launcher at once
    sampler: str = "tpe"  # tpe | random | grid (every combination of choice/range values)
    seed: int = 0  # the sampler's seed
    objective: str = "final_accuracy"  # a key of the run's summary.json
    direction: str = "maximize"  # maximize | minimize
    study_name: str = "fl"
    storage: str | None = None  # an Optuna storage URL; default: sqlite in the sweep directory
    params: dict[str, str] = field(default_factory=dict)  # the search space, as overrides


ConfigStore.instance().store(
    group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="adaptive-fl"
)


def _distribution(override: Override) -> "BaseDistribution | None":
    """The Optuna distribution of a sweep override; None for a fixed value."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not override.is_sweep_override():
        return None
    if override.is_discrete_sweep():  # a,b / choice(a,b) / range(a,b)
        return CategoricalDistribution(list(override.sweep_iterator()))
    interval = override.value()
    assert isinstance(interval, IntervalSweep)
    log_scale = "log" in interval.tags
    low, high = interval.start, interval.end
    if isinstance(low, int) and isinstance(high, int):
        return IntDistribution(low, high, log=log_scale)
    return FloatDistribution(float(low), float(high), log=log_scale)


def _grid(space: dict[str, "BaseDistribution"]) -> list[dict[str, Any]]:
    """Every combination of the space's values, in the order the overrides give them."""
    names = list(space)
    values = [space[n].choices for n in names]  # type: ignore[attr-defined]
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*values)]


def _override_value(value: Any) -> str:
    """A sampled value as a Hydra override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


class OptunaSweeper(Sweeper):
    """Ask Optuna for trials, run them through the configured launcher, tell it the results."""

    def __init__(self, **settings: Any) -> None:
        self.settings = OptunaSweeperConf(**settings)
        s = self.settings
        if s.sampler not in SAMPLERS:
            raise HydraException(f"hydra.sweeper.sampler={s.sampler!r}: one of {SAMPLERS}")
        if s.direction not in ("maximize", "minimize"):
            raise HydraException(f"hydra.sweeper.direction={s.direction!r}: maximize|minimize")
        if s.n_trials < 1 or s.n_jobs < 1:
            raise HydraException("hydra.sweeper.n_trials and n_jobs must be >= 1")

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        """Hydra's call before `sweep`: the launcher that will run the trials."""
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def _space(self, arguments: Sequence[str]) -> tuple[dict[str, "BaseDistribution"], list[str]]:
        """The search space and the fixed overrides every trial gets."""
        params = [f"{k}={v}" for k, v in self.settings.params.items()]
        by_key: dict[str, Override] = {}  # as Hydra's basic sweeper: the command line wins
        for override in OverridesParser.create().parse_overrides([*params, *arguments]):
            by_key[override.get_key_element()] = override
        space: dict[str, BaseDistribution] = {}
        fixed: list[str] = []
        for key, override in by_key.items():
            distribution = _distribution(override)
            if distribution is None:
                fixed.append(f"{key}={override.get_value_element_as_str()}")
            else:
                space[key] = distribution
        if not space:
            raise HydraException(
                "hydra/sweeper=optuna: nothing to tune; give a search space, e.g. "
                "'lr=choice(0.1,0.3)' or hydra.sweeper.params.lr='tag(log,interval(0.01,1))'"
            )
        return space, fixed

    def _study(self, sweep_dir: Path, space: dict[str, "BaseDistribution"]) -> "optuna.Study":
        import optuna

        s = self.settings
        if s.sampler == "grid":
            for name, dist in space.items():
                if not isinstance(dist, optuna.distributions.CategoricalDistribution):
                    raise HydraException(
                        f"hydra.sweeper.sampler=grid: {name} is an interval; give its values "
                        "(choice(...) or range(...))"
                    )
            # the grid's points are enqueued (`_budget_left`); Optuna's GridSampler stops the
            # study from inside `tell`, which only an `optimize` loop may do
            sampler: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=s.seed)
        elif s.sampler == "random":
            sampler = optuna.samplers.RandomSampler(seed=s.seed)
        else:
            sampler = optuna.samplers.TPESampler(seed=s.seed)
        storage = s.storage or f"sqlite:///{(sweep_dir / 'optuna.db').resolve()}"
        return optuna.create_study(
            study_name=s.study_name,
            storage=storage,
            sampler=sampler,
            direction=s.direction,
            load_if_exists=True,
        )

    def _budget_left(self, study: "optuna.Study", space: dict[str, "BaseDistribution"]) -> int:
        """Trials still to run: the budget (at most the grid's size) less those that ran.
        Trials a killed study left running are closed as failed and do not count."""
        from optuna.trial import Trial, TrialState

        for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            Trial(study, frozen._trial_id).set_user_attr(INTERRUPTED, True)
            study.tell(frozen.number, state=TrialState.FAIL)
            log.info("trial %d was cut off by an earlier stop: not counted", frozen.number)
        ran = [
            t for t in study.trials if t.state.is_finished() and not t.user_attrs.get(INTERRUPTED)
        ]
        budget = self.settings.n_trials
        if self.settings.sampler == "grid":
            grid = _grid(space)
            budget = min(budget, len(grid))
            waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            covered = [t.params for t in (*ran, *waiting)]
            for point in grid[:budget]:
                if point not in covered:
                    study.enqueue_trial(point)
        return max(0, budget - len(ran))

    def _value(self, result: JobReturn) -> float | None:
        """The trial's objective from its run's summary; None if the run failed or lacks it."""
        if result.status != JobStatus.COMPLETED or not isinstance(result.return_value, dict):
            return None
        value = result.return_value.get(self.settings.objective)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            return None
        return float(value)

    def sweep(self, arguments: list[str]) -> None:
        """Run the study until its budget is spent, then write `best.yaml`."""
        from optuna.trial import TrialState

        assert self.config is not None and self.launcher is not None, "setup() comes first"
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        space, fixed = self._space(arguments)
        study = self._study(sweep_dir, space)
        left = self._budget_left(study, space)
        log.info(
            "study %s: %d trials to run (sampler %s)", study.study_name, left, self.settings.sampler
        )
        while left > 0:
            trials = [study.ask(space) for _ in range(min(left, self.settings.n_jobs))]
            batch = [
                [*fixed, *(f"{k}={_override_value(v)}" for k, v in t.params.items())]
                for t in trials
            ]
            self.validate_batch_is_legal(batch)
            results = self._launch(trials, batch)
            crashed = 0
            for trial, result in zip(trials, results, strict=True):
                value = self._value(result)
                if value is not None:
                    study.tell(trial, value)
                    continue
                # no value: the trial does not count towards the best; a run that finished
                # without the key (time_to_target_s: the target was not reached) is no crash
                study.tell(trial, state=TrialState.FAIL)
                if result.status != JobStatus.COMPLETED:
                    crashed += 1
                    log.warning("trial %d failed; see its run.log", trial.number)
                else:
                    log.info("trial %d reported no %s", trial.number, self.settings.objective)
            if crashed == len(trials) and not any(
                t.state == TrialState.COMPLETE for t in study.trials
            ):
                raise HydraException("every trial so far failed; see the trials' run.log")
            left -= len(trials)
        self._write_best(study, fixed, sweep_dir)

    def _launch(
        self, trials: list["optuna.trial.Trial"], batch: list[list[str]]
    ) -> Sequence[JobReturn]:
        """One batch through the launcher; job directories are named by trial number, so a
        resumed study adds new ones beside the old."""
        numbers = [t.number for t in trials]
        if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
            raise HydraException(
                f"trials {numbers} are not consecutive: is another study writing to this storage?"
            )
        assert self.launcher is not None
        return self.launcher.launch(batch, initial_job_idx=numbers[0])

    def _write_best(self, study: "optuna.Study", fixed: list[str], sweep_dir: Path) -> None:
        from optuna.trial import TrialState

        done = [t for t in study.trials if t.state == TrialState.COMPLETE]
        if not done:
            raise HydraException("no trial completed: nothing to report")
        best = study.best_trial
        report = {
            "objective": self.settings.objective,
            "direction": self.settings.direction,
            "value": best.value,
            "trial": best.number,
            "trials_completed": len(done),
            "sampler": self.settings.sampler,
            "seed": self.settings.seed,
            "params": dict(best.params),
            "overrides": [f"{k}={_override_value(v)}" for k, v in best.params.items()],
            "fixed": fixed,
        }
        write_atomic(sweep_dir / BEST, yaml.safe_dump(report, sort_keys=False))
        log.info(
            "best trial %d: %s = %s with %s",
            best.number,
            self.settings.objective,
            best.value,
            best.params,
        )
