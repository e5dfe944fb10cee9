"""The run configuration: composed by Hydra, validated before round 1, shipped to apps.

Every process of a run (the ServerApp, each ClientApp, on any engine) reads the same
resolved configuration from Flower's `run_config`: either the whole config as JSON
under `fl-config` (what `fl-run` sends), or Hydra overrides under `overrides`
(what `flwr run -c "overrides='strategy=fedprox rounds=5'"` sends), composed here
from the `conf/` tree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "compose",
    "from_run_config",
    "plain",
    "run_config_key",
    "to_run_config",
    "validate",
]

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
RUN_CONFIG_KEY = "fl-config"

DATASETS = ("digits", "synthetic", "mnist", "cifar10")
MODELS = ("logreg", "mlp", "cnn", "lenet5", "resnet18")
SCHEMES = ("iid", "dirichlet", "shards", "natural")
ENGINES = ("local", "flower-sim", "deployment")
LOGGERS = ("jsonl", "wandb")
DEVICES = ("auto", "cpu", "cuda")
PRIVACY = ("none", "dpsgd", "central")


class ConfigError(ValueError):
    """An invalid configuration key or value, named in the message."""


def plain(node: Any) -> dict[str, Any]:
    """A config node as a plain dict with interpolations resolved."""
    if not isinstance(node, DictConfig):
        return dict(node)
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config of `conf/config.yaml` with Hydra command-line style overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides or [])


def to_run_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, str]:
    """Flower run_config carrying the resolved config (Hydra's own keys dropped)."""
    values = plain(cfg)
    values.pop("hydra", None)
    return {RUN_CONFIG_KEY: json.dumps(values, sort_keys=True)}


@lru_cache(maxsize=8)
def _parse(text: str) -> DictConfig:
    return OmegaConf.create(json.loads(text))


@lru_cache(maxsize=8)
def _compose_cached(overrides: str) -> DictConfig:
    cfg = compose(overrides.split())
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=False))
    values.pop("hydra", None)
    return OmegaConf.create(values)


def run_config_key(run_config: Mapping[str, Any]) -> str:
    """A string that identifies a run's config (for per-process caches)."""
    if RUN_CONFIG_KEY in run_config:
        return RUN_CONFIG_KEY + ":" + str(run_config[RUN_CONFIG_KEY])
    return "overrides:" + str(run_config.get("overrides", ""))


def from_run_config(run_config: Mapping[str, Any]) -> DictConfig:
    """The run's config, from either form of run_config (cached per process)."""
    if RUN_CONFIG_KEY in run_config:
        return _parse(str(run_config[RUN_CONFIG_KEY]))
    return _compose_cached(str(run_config.get("overrides", "")))


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"invalid config: {key}={value!r}: {rule}")


def _int_at_least(cfg: DictConfig, key: str, low: int) -> None:
    value = OmegaConf.select(cfg, key)
    _require(
        isinstance(value, int) and not isinstance(value, bool), key, value, "must be an integer"
    )
    _require(value >= low, key, value, f"must be >= {low}")


def _one_of(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    value = OmegaConf.select(cfg, key)
    _require(value in choices, key, value, f"must be one of {list(choices)}")


def _number(cfg: DictConfig, key: str, low: float, high: float = math.inf) -> None:
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high
    _require(ok, key, value, f"must be a number in [{low}, {high}]")


def _validate_privacy(cfg: DictConfig) -> None:
    """privacy=none | dpsgd | central; with DP-SGD the model must be one Opacus can train."""
    _one_of(cfg, "privacy.name", PRIVACY)
    name = cfg.privacy.name
    if name == "dpsgd":
        _number(cfg, "privacy.noise_multiplier", 0.0)
        _number(cfg, "privacy.max_grad_norm", 1e-12)
        _number(cfg, "privacy.delta", 1e-300, 1.0)
        if cfg.privacy.target_epsilon is not None:
            _number(cfg, "privacy.target_epsilon", 1e-6)
        _one_of(cfg, "privacy.accountant", ("rdp", "prv", "gdp"))
        _one_of(cfg, "privacy.sampling", ("poisson", "shuffle"))
        if OmegaConf.select(cfg, "privacy.ledger.path"):
            _one_of(cfg, "privacy.ledger.scheduler", ("dpbalance", "dpf", "dpk", "fcfs"))
            _number(cfg, "privacy.ledger.demand_epsilon", 1e-12)
            _number(cfg, "privacy.ledger.block_budget", 1e-12)
            _number(cfg, "privacy.ledger.beta", 0.0)
            if OmegaConf.select(cfg, "privacy.ledger.kappa_max") is not None:
                _number(cfg, "privacy.ledger.kappa_max", 1.0)
        layer = _dp_incompatible_layer(cfg)
        _require(layer is None, "task.model", cfg.task.model, f"Opacus cannot train {layer}")
    if name in ("dpsgd", "central"):
        _one_of(cfg, "privacy.server_dp.mode", ("none", "fixed", "adaptive"))
        if cfg.privacy.server_dp.mode != "none":
            _number(cfg, "privacy.server_dp.noise_multiplier", 0.0)
            _number(cfg, "privacy.server_dp.clipping_norm", 1e-12)
            _number(cfg, "privacy.server_dp.target_clipped_quantile", 0.0, 1.0)
            _number(cfg, "privacy.server_dp.clip_norm_lr", 0.0)


def _dp_incompatible_layer(cfg: DictConfig) -> str | None:
    """The first layer of the run's model that Opacus rejects (e.g. BatchNorm), or None."""
    from opacus.validators import ModuleValidator

    from fl.models import build_model

    image = cfg.task.model in ("cnn", "lenet5", "resnet18")  # layer types ignore input size
    hidden = tuple(cfg.task.get("hidden") or (64,))
    model = build_model(cfg.task.model, (3, 32, 32) if image else (64,), 10, hidden=hidden)
    for name, module in model.named_modules():
        check = ModuleValidator.VALIDATORS.get(type(module))
        errors = check(module) if check is not None else []
        if errors:
            return f"layer {name!r} ({type(module).__name__}): {str(errors[0]).split('. ')[0]}"
    return None


def validate(cfg: DictConfig) -> None:
    """Check every option before the run starts; raise ConfigError naming the bad key."""
    from fl.registry import get_strategy

    for key in ("num_clients", "clients_per_round", "rounds", "batch_size"):
        _int_at_least(cfg, key, 1)
    _int_at_least(cfg, "local_steps", 0)
    _int_at_least(cfg, "local_epochs", 0 if cfg.local_steps > 0 else 1)
    _int_at_least(cfg, "checkpoint_every", 1)
    _int_at_least(cfg, "torch_threads", 0)
    _require(
        cfg.clients_per_round <= cfg.num_clients,
        "clients_per_round",
        cfg.clients_per_round,
        f"must be <= num_clients ({cfg.num_clients})",
    )
    for key in ("lr", "round_timeout_s"):
        value = cfg[key]
        _require(isinstance(value, int | float) and value > 0, key, value, "must be a number > 0")
    for key in ("momentum", "weight_decay"):
        value = cfg[key]
        _require(isinstance(value, int | float) and value >= 0, key, value, "must be a number >= 0")
    _require(
        isinstance(cfg.max_update_norm, int | float) and cfg.max_update_norm > 0,
        "max_update_norm",
        cfg.max_update_norm,
        "must be a number > 0 (.inf for no bound)",
    )
    target = cfg.target_accuracy
    _require(
        target is None or (isinstance(target, int | float) and 0 < target <= 1),
        "target_accuracy",
        target,
        "must be null or in (0, 1]",
    )
    budget = cfg.get("time_budget_s")
    _require(
        budget is None or (isinstance(budget, int | float) and budget > 0),
        "time_budget_s",
        budget,
        "must be null or a number > 0",
    )
    rates = [cfg.faults[kind] for kind in ("crash", "dropout", "hang")]
    _require(
        all(isinstance(r, int | float) and 0 <= r <= 1 for r in rates) and sum(rates) <= 1,
        "faults",
        rates,
        "crash, dropout and hang rates must be in [0, 1] and sum to at most 1",
    )
    _one_of(cfg, "device", DEVICES)
    _one_of(cfg, "task.dataset", DATASETS)
    _one_of(cfg, "task.model", MODELS)
    _one_of(cfg, "partition.scheme", SCHEMES)
    _one_of(cfg, "engine.name", ENGINES)
    _one_of(cfg, "logger.name", LOGGERS)
    _validate_privacy(cfg)
    if cfg.partition.scheme == "dirichlet":
        alpha = cfg.partition.alpha
        _require(
            isinstance(alpha, int | float) and alpha > 0, "partition.alpha", alpha, "must be > 0"
        )
    if cfg.partition.scheme == "natural":
        _require(
            cfg.task.dataset == "synthetic", "partition.scheme", "natural", "needs task=synthetic"
        )
    system = cfg.system
    for key in ("speed", "up_mbps", "down_mbps"):
        _require(system[key] > 0, f"system.{key}", system[key], "must be > 0")
    for key in ("speed_spread", "bandwidth_spread"):
        _require(system[key] >= 1, f"system.{key}", system[key], "must be >= 1")
    _require(
        0 < system.availability <= 1,
        "system.availability",
        system.availability,
        "must be in (0, 1]",
    )
    if cfg.engine.name == "local":
        _int_at_least(cfg, "engine.workers", 1)
    strategy = plain(cfg.strategy)
    try:
        get_strategy(str(strategy["name"])).make_params(strategy)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid config: strategy: {err}") from err
