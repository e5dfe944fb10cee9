"""Every config group's check, run in one fixed order before round 1.

Each subsystem checks its own group with a function beside it (`check_task` in
`fl.world.task`, `check_loop` in `fl.run.loops`, `check_privacy` in `privacy.config`, ...).
pyproject registers each under the `fl.config_checks` entry-point group, so this module
imports none of them, and a plugin adds the check of its own group the way it adds a
strategy. A ConfigError names the bad key; nothing starts until every check has passed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points

from omegaconf import DictConfig

__all__ = ["ENTRY_POINT_GROUP", "ORDER", "checks", "validate"]

ENTRY_POINT_GROUP = "fl.config_checks"
# Ours, in the order they run: a later check may rely on an earlier one's keys (the loop's
# check reads the strategy the strategy check accepted). Plugins' checks run after these.
# The checks whose modules need no torch come first, and each check's module is imported
# only when its turn comes: a typo in a top-level key is refused in well under a second.
ORDER = (
    "keys",
    "run",
    "system",
    "logger",
    "engine",
    "faults",
    "aggregation",
    "attacks",
    "task",
    "privacy",
    "strategy",
    "loop",
    "privacy-strategy",
    "transport",
)

Check = Callable[[DictConfig], None]


class _Lazy:
    """A registered check, imported on its first call: an early refusal skips the modules
    (torch, Flower) that the later checks live beside."""

    def __init__(self, entry_point: EntryPoint) -> None:
        self.entry_point = entry_point
        self._check: Check | None = None

    def __call__(self, cfg: DictConfig) -> None:
        if self._check is None:
            self._check = self.entry_point.load()
        self._check(cfg)


@lru_cache(maxsize=1)
def checks() -> tuple[tuple[str, Check], ...]:
    """(name, check) of every registered config check: ours in ORDER, then the rest by name."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    missing = [name for name in ORDER if name not in found]
    if missing:
        raise RuntimeError(
            f"config checks {missing} are not registered: the installed metadata of "
            "adaptive-fl is stale; reinstall it (make setup, or pip install -e .)"
        )
    names = [*ORDER, *sorted(set(found) - set(ORDER))]
    return tuple((name, _Lazy(found[name])) for name in names)


def validate(cfg: DictConfig) -> None:
    """Check every option before the run starts; raise ConfigError naming the bad key.

    Also run by the ServerApp on the final config, where `output_dir` is fl-run's absolute
    run directory: here any absolute path passes; fl-run's `preflight` refuses a user's own.
    """
    for _, check in checks():
        check(cfg)
