"""Overrides of keys the config does not have (`strategy.muu=0.1`), refused in one line.

Hydra's own error is a seven-line dump that advises `+strategy.muu=0.1`, which would add
the typo as a new key; once Hydra has refused a command line (`fl.run.cli`), this check
composes the config again without the suspect keys (and without the values, which the
checks of `fl.run.validation` judge later) and names the closest existing key instead.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from omegaconf import DictConfig, OmegaConf

__all__ = ["check_override_keys"]


def _plain_overrides(argv: Iterable[str]) -> list[tuple[str, str, str]]:
    """(prefix, key, value) of every `KEY=VALUE` argument; flags and Hydra's own skipped."""
    found = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        prefix = arg[:2] if arg.startswith("++") else arg[:1] if arg[:1] in "+~" else ""
        key, _, value = arg[len(prefix) :].partition("=")
        if key.split(".")[0].split("/")[0] != "hydra":
            found.append((prefix, key, value))
    return found


def _first_option(value: str) -> str:
    """A sweep's first value (`fedavg,fedprox` -> `fedavg`); a list or quoted value whole."""
    return value if value[:1] in "[{'\"" else value.split(",")[0]


def _missing(cfg: DictConfig, key: str) -> tuple[str, list[str]] | None:
    """(parent path, its keys) if `key` is not in `cfg` although its parent is a mapping."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or leaf in node:
        return None
    return parent, sorted(str(k) for k in node)


def _compose(overrides: list[str]) -> DictConfig | None:
    """The config these overrides compose to, Hydra's own node included; None if Hydra
    refuses them (it then reports its own error, as before)."""
    from hydra import compose, initialize_config_dir

    from fl.common.config import CONF_DIR

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except Exception:  # whatever Hydra refuses, Hydra reports, as before
        return None


class _Compositions(dict[tuple[str, ...], "DictConfig | None"]):
    """Each distinct override list composed once: most suspects (`rounds=3`, `plots=false`)
    look themselves up in the same config, and a composition costs ~0.3 s."""

    def __missing__(self, overrides: tuple[str, ...]) -> DictConfig | None:
        self[overrides] = cfg = _compose(list(overrides))
        return cfg


def _preset_sweeps(
    argv: list[str], kept: list[tuple[str, str, str]], composed: _Compositions
) -> list[tuple[str, str, str]]:
    """A multirun preset's own sweeps (`hydra.sweeper.params`), as overrides: each of its
    jobs gets the user's overrides too, so each must have the user's keys."""
    cfg = composed[tuple(f"{p}{k}={_first_option(v)}" for p, k, v in kept)]
    if cfg is None:
        return []
    multirun = str(OmegaConf.select(cfg, "hydra.mode")) == "RunMode.MULTIRUN"
    params = OmegaConf.select(cfg, "hydra.sweeper.params")
    if not (multirun or "-m" in argv or "--multirun" in argv) or not params:
        return []
    given = {k for _, k, _ in kept}
    return [
        (str(name)[:1] if str(name)[:1] in "+~" else "", str(name).lstrip("+~"), str(value))
        for name, value in params.items()
        if str(name).lstrip("+~") not in given
    ]


def check_override_keys(argv: list[str], groups: Iterable[str]) -> None:
    """Exit in one line if a plain `A.B=V` (or top-level `A=V`, A not a group) names a key
    that a composed job's config lacks, suggesting the closest one, never `+A.B`.

    Each sweep over the key's group (`strategy=fedavg,fedprox`, on the command line or in a
    preset's `hydra.sweeper.params`) is looked up option by option, other sweeps by their
    first value: every config looked at is one a job of the run would have."""
    overrides = _plain_overrides(argv)
    groups = set(groups)
    suspects = [
        key
        for prefix, key, _ in overrides
        if prefix == "" and not {"@", "/"} & set(key) and ("." in key or key not in groups)
    ]
    if not suspects or any(a.startswith("~") or "(" in a for a in argv):
        return  # nothing to look up; a deletion or sweep expression is Hydra's to expand
    kept = [(p, k, v) for p, k, v in overrides if not (p == "" and k in suspects)]
    composed = _Compositions()
    kept += _preset_sweeps(argv, kept, composed)
    for key in suspects:
        top = key.split(".")[0]
        options = next((v.split(",") for p, k, v in kept if p == "" and k == top), [""])
        for option in options:
            chosen = (f"{p}{k}={option if k == top else _first_option(v)}" for p, k, v in kept)
            cfg = composed[tuple(chosen)]
            if cfg is not None and _missing(cfg, key) is not None:
                raise SystemExit(_refusal(cfg, key, option))


def _refusal(cfg: DictConfig, key: str, option: str) -> str:
    """The line that names the missing `key`, the group option it was looked up in and the
    closest existing key (or the keys there are)."""
    parent, keys = _missing(cfg, key) or ("", [])
    top, leaf = key.split(".")[0], key.rpartition(".")[2]
    keys = [k for k in keys if k != "hydra"]
    close = difflib.get_close_matches(leaf, keys, n=1)
    choice = OmegaConf.select(cfg, f"hydra.runtime.choices.{top}") or option
    chosen_by = f" (with {top}={choice})" if choice and parent else ""
    where = f"{parent} has no key {leaf!r}{chosen_by}" if parent else "not in conf/config.yaml"
    prefix = f"{parent}." if parent else ""
    hint = f"did you mean {prefix}{close[0]}?" if close else f"its keys: {', '.join(keys)}"
    return f"fl-run: {key}: {where}; {hint}"
