"""`fl-run`: the Hydra entry point (also `python -m fl.run`).

Composes and validates the config, makes sure the output directory holds no other run
(unless `resume=true` or `overwrite=true`), then hands the resolved config to the
chosen engine with the ServerApp and ClientApp it loads by reference (`fl.run.apps`).
Problems the user can fix end in one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import os
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

import fl  # noqa: F401  (sets the offline environment before Flower is imported)
from fl.common.config import CONF_DIR, ConfigError, plain, require, to_run_config
from fl.common.errors import RunError
from fl.common.files import make_dir, read_regular_text, write_atomic
from fl.run.override_keys import check_override_keys
from fl.run.settings import OUTPUT_DIR_RULE, run_overrides
from fl.run.tracking import holds_run, refuse_existing_run, run_defining
from fl.run.validation import validate

__all__ = ["latest_run", "main", "preflight"]

log = logging.getLogger(__name__)
OUTPUTS = Path("outputs")  # where `hydra.run.dir` points by default (conf/config.yaml)
OVERRIDES = Path(".hydra") / "overrides.yaml"  # the command line of a run, for labels and resume
JOB_LOG = "run.log"  # Hydra's job log (conf/config.yaml: hydra.job.name)
HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"  # set: Hydra raises what it would print
HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."


def _save_overrides(out_dir: Path, *, resume: bool) -> None:
    """Keep this command line beside the run (Hydra's own copy is off: it would overwrite)."""
    path = out_dir / OVERRIDES
    if resume and path.exists():
        return  # a resume keeps the command line that started the run
    make_dir(path.parent)
    write_atomic(path, yaml.safe_dump(run_defining(list(HydraConfig.get().overrides.task))))


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _main(cfg: DictConfig) -> dict[str, Any] | None:
    """One run; its summary is the job's return value (a sweeper's objective reads it)."""
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    new_dir = hydra_cfg.mode == RunMode.RUN and _holds_only(out_dir, JOB_LOG)
    try:
        validate(cfg)
        preflight(cfg)  # the user's output_dir; device, data files and partition sizes
        resume = bool(cfg.resume)
        if resume and hydra_cfg.mode == RunMode.MULTIRUN and not holds_run(out_dir):
            resume = False  # an arm the interrupted sweep never started: start it
            print(f"fl-run: {out_dir} holds no run yet: starting this arm", flush=True)
        refuse_existing_run(out_dir, resume=resume, overwrite=bool(cfg.overwrite))
        forked = _fork(cfg, out_dir)  # checks its source before anything is written here
        _save_overrides(out_dir, resume=resume)
        with open_dict(cfg):
            cfg.output_dir = str(out_dir)
            cfg.resume = forked or resume
        print(f"fl-run: run directory {out_dir}", flush=True)
        from fl.run.apps import Apps  # Flower: only once the config has passed its checks
        from fl.run.engines import run_engine

        run_engine(cfg, to_run_config(cfg), Apps.load())
    except (ConfigError, RunError) as err:
        if new_dir:
            _clear_refused(out_dir)
        raise SystemExit(f"fl-run: {err}") from None
    summary = out_dir / "summary.json"  # absent where the SuperLink's machine holds the run
    return json.loads(read_regular_text(summary)) if summary.exists() else None


def _holds_only(folder: Path, *names: str) -> bool:
    """Whether `folder` holds nothing but `names` (Hydra made it for this run just now)."""
    try:
        return set(os.listdir(folder)) <= set(names)
    except OSError:
        return False


def _clear_refused(out_dir: Path) -> None:
    """A run refused before its first round leaves no folder behind (its one error line
    says why): what this invocation put into the folder Hydra made for it (run.log,
    .hydra/overrides.yaml, a fork's copy of its source checkpoint) goes, then the folder.
    A run that wrote metrics rows keeps everything."""
    if (out_dir / "metrics.jsonl").exists():
        return
    for name in (JOB_LOG, str(OVERRIDES), "checkpoint.pt", "checkpoint.pt.tmp"):
        (out_dir / name).unlink(missing_ok=True)  # a link itself, never its target
    for folder in (out_dir / OVERRIDES.parent, out_dir):
        with contextlib.suppress(OSError):  # not empty: something else is there, kept
            folder.rmdir()


def preflight(cfg: DictConfig) -> None:
    """fl-run's checks of the user's config before it sets `output_dir` and starts the engine.

    Refuses a user-given `output_dir` (fl-run sets it; only engine=deployment takes one, an
    absolute path on the SuperLink's machine). Unless the clients run elsewhere
    (deployment), builds the task as the ServerApp will: the device exists, the dataset's
    files are there and the partition gives every client its examples. The task is
    cached, so the ServerApp in this process (local, flower-sim) does not load it again.
    """
    explicit = cfg.get("output_dir")
    deployment = cfg.engine.name == "deployment"
    require(explicit is None or deployment, "output_dir", explicit, OUTPUT_DIR_RULE)
    if not deployment:
        from fl.world.task import get_task  # torch and the data: not for `fl-run --version`

        get_task(cfg)


def _fork(cfg: DictConfig, out_dir: Path) -> bool:
    """`fork_from`: put the source's checkpoint into this new run directory; whether the run
    is to resume from it (not when it already holds the fork's own checkpoint: resume)."""
    spec = cfg.get("fork_from")
    if not spec or (cfg.resume and (out_dir / "checkpoint.pt").exists()):
        return False
    if cfg.engine.name == "deployment":
        raise ConfigError(
            "invalid config: fork_from: needs the run directory on this machine "
            "(engine=local or flower-sim)"
        )
    from fl.run.checkpoint import fork_into  # torch: not for `fl-run --version`

    fork_into(str(spec), out_dir, plain(cfg))
    return True


def latest_run(root: Path = OUTPUTS) -> Path | None:
    """The run directory under `root` whose checkpoint was written last, if any."""
    checkpoints = [p for p in root.glob("**/checkpoint*.pt") if p.is_file()]
    if not checkpoints:
        return None
    return max(checkpoints, key=lambda p: p.stat().st_mtime).parent.resolve()


def _expand_resume_latest(argv: list[str]) -> list[str]:
    """`resume=latest` -> the latest run's own overrides, then the user's, then its dir."""
    if "resume=latest" not in argv:
        return argv
    run_dir = latest_run()
    if run_dir is None:
        raise SystemExit(f"fl-run: resume=latest: no run with a checkpoint under {OUTPUTS}/")
    from fl.run.checkpoint import CHECKPOINT, load_checkpoint  # torch: only for a resume

    try:
        load_checkpoint(run_dir / CHECKPOINT, required=("config",))  # before its overrides
        saved_path = run_dir / OVERRIDES
        text = read_regular_text(saved_path) if saved_path.exists() else "[]"
        saved = run_overrides(yaml.safe_load(text), str(saved_path), _group_options)
    except (RunError, ConfigError, yaml.YAMLError, UnicodeDecodeError) as err:
        raise SystemExit(f"fl-run: resume=latest: {run_dir}: {err}") from None
    kept = run_defining(saved)  # runs saved before these were left out carry them
    rest = [a for a in argv if a != "resume=latest"]
    print(f"fl-run: resuming {run_dir}", flush=True)
    return [*kept, *rest, f"hydra.run.dir={run_dir}", "resume=true"]


@functools.cache
def _group_options(group: str) -> list[str] | None:
    """The options of config group `group` (`strategy`, `experiment/asfl_arm`) in conf/ and
    in strategy plugins' conf/; None if no such group."""
    from hydra_plugins.adaptive_fl import plugin_conf_dirs, strategy_names

    folders = [root / group for root in (CONF_DIR, *plugin_conf_dirs())]
    folders = [f for f in folders if f.is_dir()]
    if not folders:
        return None
    # an installed strategy without its yaml is an option too (its params' defaults)
    installed = strategy_names() if group == "strategy" else []
    return sorted({p.stem for f in folders for p in f.glob("*.yaml")} | set(installed))


def _check_choices(argv: list[str]) -> None:
    """`GROUP=OPTION` overrides whose option does not exist, refused in one line with the
    choices (Hydra's own error is a multi-line dump). Sweeps (`a,b`) are checked per option."""
    for arg in argv:
        key, equals, value = arg.lstrip("+~").partition("=")
        group = key.partition("@")[0]
        if not equals or arg.startswith("-") or not value.replace(",", "").strip():
            continue
        options = _group_options(group) if group.replace("/", "").isidentifier() else None
        if options is None or not all(v.replace("_", "").isalnum() for v in value.split(",")):
            continue  # not a group, or a sweep expression (choice(...), range(...)) for Hydra
        missing = [v for v in value.split(",") if v not in options and v != "null"]
        if missing:
            close = difflib.get_close_matches(missing[0], options, n=1)
            hint = f"did you mean {group}={close[0]}? " if close else ""
            raise SystemExit(
                f"fl-run: {group}={missing[0]}: no such option; {hint}choices: {', '.join(options)}"
            )


def _groups() -> list[str]:
    """The config groups (`strategy`, `task`, ...): their names select an option, not a key."""
    from hydra_plugins.adaptive_fl import plugin_conf_dirs

    roots = (CONF_DIR, *plugin_conf_dirs())
    return sorted({d.name for root in roots for d in root.iterdir() if d.is_dir()})


def main() -> None:
    """Console-script entry point."""
    if "--version" in sys.argv[1:]:
        versions = f"flwr {version('flwr')}, torch {version('torch')}"
        print(f"adaptive-fl {version('adaptive-fl')} ({versions})")
        return
    argv = sys.argv[1:]
    _check_choices(argv)
    sys.argv[1:] = _expand_resume_latest(argv)
    with _key_typos_named(argv):
        _main()


@contextlib.contextmanager
def _key_typos_named(argv: list[str]) -> Iterator[None]:
    """Hydra prints a refused command line as a dump that advises `+strategy.muu=0.1`;
    told to raise instead (HYDRA_FULL_ERROR, for this process), it lets a key typo be named
    in one line here (`check_override_keys`, which composes the config only now, not
    before every run: ~0.1 CPU s). Other composition errors print as Hydra prints them;
    anything else raised with its whole traceback (a bug, not a command line to fix)."""
    from hydra.errors import CompactHydraException, ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    chosen = os.environ.get(HYDRA_FULL_ERROR)
    os.environ[HYDRA_FULL_ERROR] = "1"
    try:
        yield
    except CompactHydraException as err:
        if chosen == "1":
            raise  # the user asked for Hydra's full error (Hydra reads "1" alone as asking)
        if isinstance(err, ConfigCompositionException):
            check_override_keys(argv, _groups())  # exits in one line if a key is misspelt
        cause = err.__cause__  # what Hydra prints beside its own line
        detail = f"\n{cause}" if isinstance(cause, OmegaConfBaseException) else ""
        raise SystemExit(f"{err}{detail}\n\n{HYDRA_HINT}") from None
    finally:
        if chosen is None:
            os.environ.pop(HYDRA_FULL_ERROR, None)
        else:
            os.environ[HYDRA_FULL_ERROR] = chosen


if __name__ == "__main__":
    main()
