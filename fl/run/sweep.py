"""A sweep's bookkeeping, whatever Hydra launcher runs its arms.

Hydra's launchers (basic, joblib, submitit, Ray) run each arm as a job, in this process
or far from it; `SweepCallback` (registered for every run in conf/config.yaml) makes the
sweep's outcome independent of which one did. At the start it writes `sweep.json`, the
number of arms the sweep holds, into the sweep directory; the job that finishes the last
arm writes `comparison.md` and the plots there, so a sweep on SLURM is compared even when
the process that submitted it is gone, and the submitting process writes the comparison
at the end only if no arm did (a failed arm, or a sweeper other than Hydra's basic one).
Resuming a sweep (`fl-run -m ... hydra.sweep.dir=DIR resume=true`) reruns no finished arm.
Each job records its folder in `sweep.json` as it starts, and only those are compared: a
folder dropped into the sweep directory is not an arm.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fl.common.errors import RunError
from fl.common.files import NotRegularFile, read_regular_text, require_writable, write_atomic
from fl.run.compare import compare_runs, find_runs

__all__ = ["MANIFEST", "SweepCallback", "launched_runs", "planned_arms"]

log = logging.getLogger(__name__)
MANIFEST = "sweep.json"  # {"arms": N, "compared": M, "launched": [job folders]}
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def planned_arms(config: DictConfig) -> int | None:
    """How many arms Hydra's basic sweeper will launch for `config`; None for other
    sweepers (Optuna's trials are decided as it goes)."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()]
    arguments += list(OmegaConf.select(config, "hydra.overrides.task") or [])
    overrides = OverridesParser.create().parse_overrides(arguments)
    return sum(len(batch) for batch in BasicSweeper.split_arguments(overrides, None))


@contextmanager
def _locked(sweep_dir: Path) -> Iterator[None]:
    """Serialise the arms that finish together (joblib, SLURM) on the sweep's lock file.
    A link planted in its place is removed, never followed: the lock holds no data."""
    lock = sweep_dir / f".{MANIFEST}.lock"
    if lock.is_symlink():
        log.warning("%s: a link, not the sweep's lock file: removed", lock)
        lock.unlink()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{lock} is not a regular file: remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_manifest(sweep_dir: Path) -> dict[str, Any]:
    """`sweep.json`'s integers, and `launched`: the job folders this sweep started."""
    path = sweep_dir / MANIFEST
    if not path.exists():
        return {}
    try:
        manifest = json.loads(read_regular_text(path))
    except (OSError, ValueError) as err:
        log.warning("%s: unreadable (%s); the comparison waits for the sweep's end", path, err)
        return {}
    if not isinstance(manifest, dict):
        return {}
    kept: dict[str, Any] = {
        k: v for k, v in manifest.items() if isinstance(v, int) and not isinstance(v, bool)
    }
    launched = manifest.get("launched")
    if isinstance(launched, list) and all(isinstance(n, str) for n in launched):
        kept["launched"] = launched
    return kept


def _write_manifest(sweep_dir: Path, manifest: dict[str, Any]) -> None:
    write_atomic(sweep_dir / MANIFEST, json.dumps(manifest) + "\n")


def launched_runs(sweep_dir: Path, manifest: dict[str, Any] | None = None) -> list[Path]:
    """The finished runs among the job folders the sweep in `sweep_dir` launched."""
    launched = set(
        (manifest if manifest is not None else _read_manifest(sweep_dir)).get("launched", [])
    )
    return [d for d in find_runs(sweep_dir) if d.name in launched]


def _fail(err: Exception) -> NoReturn:
    """End the sweep in one line, non-zero: Hydra turns a callback's exception into a
    warning, and a sweep that lost its comparison must not exit 0."""
    raise SystemExit(f"fl-run: sweep: {err}") from None


def _compare(config: DictConfig, sweep_dir: Path, run_dirs: list[Path]) -> None:
    title = str(config.get("experiment_title") or sweep_dir.name)
    plots = bool(config.get("plots", True))
    print(compare_runs(run_dirs, sweep_dir, title, plots=plots))
    print(f"comparison written to {sweep_dir}/comparison.md" + " and plots" * plots)


class SweepCallback(Callback):
    """Hydra callback: count a sweep's arms, and compare them once the last one ends."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Record how many arms the sweep holds, and that none was launched yet (a folder
        already there, or planted, is no arm of this sweep until one of its jobs starts)."""
        arms = planned_arms(config)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        manifest: dict[str, Any] = {"compared": 0, "launched": []}
        try:
            require_writable(sweep_dir / "multirun.yaml")  # Hydra's basic sweeper writes it next
            with _locked(sweep_dir):
                _write_manifest(sweep_dir, manifest if arms is None else {"arms": arms, **manifest})
        except (OSError, RunError) as err:
            _fail(err)
        if arms is None:
            return
        cores = len(os.sched_getaffinity(0))
        log.info(
            "sweep of %d arms in %s; %d cores here: hydra/launcher=joblib "
            "hydra.launcher.n_jobs=N runs N arms at once (README, Sweeps)",
            arms,
            sweep_dir,
            cores,
        )

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Record this job's folder as an arm the sweep launched: only those are compared."""
        if OmegaConf.select(config, "hydra.mode") != RunMode.MULTIRUN:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        job = Path(config.hydra.runtime.output_dir)
        if job.parent.resolve() != sweep_dir.resolve():
            return  # a custom hydra.sweep.subdir: find_runs does not look there either
        try:
            with _locked(sweep_dir):
                manifest = _read_manifest(sweep_dir)
                launched = manifest.get("launched", [])
                if job.name not in launched:
                    _write_manifest(sweep_dir, {**manifest, "launched": [*launched, job.name]})
        except (OSError, RunError) as err:
            _fail(err)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """In the job that finishes a sweep's last arm, wherever it runs: the comparison."""
        if job_return.status != JobStatus.COMPLETED:
            return
        if OmegaConf.select(config, "hydra.mode") != RunMode.MULTIRUN:
            return
        _compare_once(config, Path(config.hydra.sweep.dir), all_arms=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """The comparison of the arms that finished, unless the last one already wrote it."""
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            _compare_once(config, sweep_dir, all_arms=False)


def _compare_once(config: DictConfig, sweep_dir: Path, *, all_arms: bool) -> None:
    """Under the sweep's lock, compare its finished arms unless these were compared already;
    with `all_arms`, only once every arm `sweep.json` counts has finished. Only the job
    folders this sweep launched are arms: a folder planted beside them is not compared."""
    try:
        with _locked(sweep_dir):
            manifest = _read_manifest(sweep_dir)
            run_dirs = launched_runs(sweep_dir, manifest)
            if not run_dirs or manifest.get("compared") == len(run_dirs):
                return
            if all_arms and len(run_dirs) < manifest.get("arms", len(run_dirs) + 1):
                return
            _compare(config, sweep_dir, run_dirs)
            _write_manifest(sweep_dir, {**manifest, "compared": len(run_dirs)})
    except (OSError, RunError, ValueError) as err:
        _fail(err)
