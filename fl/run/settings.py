"""The run's own top-level keys (`conf/config.yaml` outside its groups) and their check."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fl.common.config import (
    CONF_DIR,
    ConfigError,
    check_choice,
    check_int,
    check_number,
    require,
)

__all__ = [
    "DEVICES",
    "FORK_FROM",
    "MAX_SEED",
    "OPTIMIZERS",
    "OUTPUT_DIR_RULE",
    "check_keys",
    "check_run",
    "run_overrides",
]

DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")  # the client's (clients/optimizers.py)
MAX_SEED = 2**32 - 1  # scikit-learn's and NumPy's legacy seeds are 32-bit
FORK_FROM = re.compile(r"[^@]+(@[1-9][0-9]*)?")  # <run_dir>[@<round>]
CHOICE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")  # a group option: a yaml stem, no path
OUTPUT_DIR_RULE = (
    "fl-run sets it to the Hydra run directory, so use hydra.run.dir=DIR instead "
    "(only engine=deployment takes an output_dir: an absolute path on the SuperLink's machine)"
)


@lru_cache(maxsize=1)
def _groups() -> tuple[str, ...]:
    """The config groups conf/config.yaml's defaults list chooses from."""
    base = OmegaConf.load(CONF_DIR / "config.yaml")
    return tuple(str(next(iter(d))).split()[-1] for d in base.defaults if isinstance(d, DictConfig))


@lru_cache(maxsize=1)
def _known_keys() -> tuple[str, ...]:
    """Top-level keys of conf/config.yaml and its config groups: all a run may set."""
    base = OmegaConf.load(CONF_DIR / "config.yaml")
    return tuple(sorted({str(k) for k in base if k != "defaults"} | set(_groups())))


def check_keys(cfg: DictConfig) -> None:
    """Refuse top-level keys added with `+` that nothing reads (a typo), suggesting the closest."""
    known = _known_keys()
    unknown = [str(k) for k in cfg if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(known)}"
        raise ConfigError(
            f"invalid config: unknown key {unknown[0]!r} (not in conf/config.yaml); {hint}"
        )


def check_run(cfg: DictConfig) -> None:
    """The top-level numbers of conf/config.yaml, the device, fork_from and output_dir."""
    for key in ("num_clients", "clients_per_round", "rounds", "batch_size"):
        check_int(cfg, key, 1)
    check_int(cfg, "local_steps", 0)
    check_int(cfg, "local_epochs", 0 if cfg.local_steps > 0 else 1)
    check_int(cfg, "checkpoint_every", 1)
    check_int(cfg, "evaluate_every", 1)  # > 1 refused by a strategy that reads every round
    check_int(cfg, "target_window", 1)
    check_int(cfg, "torch_threads", 0)
    check_int(cfg, "seed", 0, MAX_SEED)
    require(
        cfg.clients_per_round <= cfg.num_clients,
        "clients_per_round",
        cfg.clients_per_round,
        f"must be <= num_clients ({cfg.num_clients})",
    )
    check_number(cfg, "lr", 0, strict=True)
    require(
        cfg.get("tuning") is None,
        "tuning",
        "(a tuning block)",
        "this preset tunes its arms first: run it with python -m fl.run.tune experiment=NAME",
    )
    check_number(cfg, "round_timeout_s", 0, strict=True, null=True)
    check_number(cfg, "momentum", 0)
    check_number(cfg, "weight_decay", 0)
    check_optimizer(cfg)
    bound = cfg.max_update_norm
    require(
        isinstance(bound, int | float) and not isinstance(bound, bool) and bound > 0,
        "max_update_norm",
        bound,
        "must be a number > 0 (.inf for no bound)",
    )
    check_number(cfg, "target_accuracy", 0, 1, strict=True, null=True)
    fork = cfg.get("fork_from")
    require(
        fork is None or (isinstance(fork, str) and bool(FORK_FROM.fullmatch(fork))),
        "fork_from",
        fork,
        "must be null, <run_dir> or <run_dir>@<round> (round a positive integer)",
    )
    for key in ("checkpoint_history", "plots", "resume", "overwrite", "progress"):
        require(isinstance(cfg.get(key, False), bool), key, cfg.get(key), "must be true or false")
    check_number(cfg, "time_budget_s", 0, strict=True, null=True)
    output_dir = cfg.get("output_dir")
    require(
        output_dir is None or (isinstance(output_dir, str) and Path(output_dir).is_absolute()),
        "output_dir",
        output_dir,
        OUTPUT_DIR_RULE,
    )
    check_choice(cfg, "device", DEVICES)


def check_optimizer(cfg: DictConfig) -> None:
    """`optimizer` is one we train with; momentum's needs a momentum, Adam's betas and eps."""
    check_choice(cfg, "optimizer", OPTIMIZERS)
    if cfg.optimizer == "momentum":
        require(cfg.momentum > 0, "momentum", cfg.momentum, "optimizer=momentum needs > 0")
    betas = cfg.betas
    require(
        OmegaConf.is_list(betas)
        and len(betas) == 2
        and all(
            isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
        ),
        "betas",
        OmegaConf.to_container(betas) if OmegaConf.is_list(betas) else betas,
        "must be two numbers in [0, 1)",
    )
    check_number(cfg, "eps", 0, strict=True)


def run_overrides(
    saved: object, source: str, group_options: Callable[[str], Sequence[str] | None]
) -> list[str]:
    """A run folder's saved command line, checked as data: KEY=VALUE strings whose key is
    one of the run's own (conf/config.yaml's keys and groups). A Hydra setting (`hydra.*`,
    `hydra/...`, a package `@hydra`), a flag or anything else is refused, naming `source`:
    Hydra would run what such a setting names (a callback's `_target_`). A group choice
    (`strategy=NAME`, `system/availability=NAME`) must name one of `group_options(group)`
    (conf/'s and installed plugins' yaml files) or null: never a path, so a run folder
    cannot choose which files are composed into the config."""
    if not isinstance(saved, list) or not all(isinstance(o, str) for o in saved):
        raise ConfigError(f"{source}: not a list of overrides")
    known = set(_known_keys())
    for override in saved:
        key, equals, value = override.lstrip("+~").partition("=")
        parts = re.split(r"[./@]", key)
        if not equals or parts[0] not in known or any(p.startswith("hydra") for p in parts):
            raise ConfigError(
                f"{source}: {override!r} is not an override of the run's own keys; "
                "a run folder is data, so it is not replayed"
            )
        group = key.partition("@")[0]
        if "/" not in group and ("." in group or group not in _groups()):
            continue  # a value, not a choice of file
        options = group_options(group) if CHOICE.fullmatch(group.replace("/", "_")) else None
        if value != "null" and not (CHOICE.fullmatch(value) and value in (options or ())):
            raise ConfigError(
                f"{source}: {override!r} is not one of the options of {group} in conf/ "
                "(a run folder is data: it does not choose which files are composed)"
            )
    return list(saved)
