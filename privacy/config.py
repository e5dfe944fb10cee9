"""The `privacy` group's checks: DP-SGD, central DP and the ledger, alone and with the
strategy and aggregation they would run with."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from fl.common.config import ConfigError, check_choice, check_number, require
from fl.strategy.registry import get_strategy
from fl.world.models import build_model

__all__ = ["MODES", "check_privacy", "check_privacy_with_strategy"]

MODES = ("none", "dpsgd", "central")


def check_privacy(cfg: DictConfig) -> None:
    """privacy=none | dpsgd | central; with DP-SGD the model must be one Opacus can train."""
    check_choice(cfg, "privacy.name", MODES)
    name = cfg.privacy.name
    ledger_path = OmegaConf.select(cfg, "privacy.ledger.path")
    if OmegaConf.select(cfg, "privacy.ledger.required", default=False):
        require(
            bool(ledger_path),
            "privacy.ledger.path",
            ledger_path,
            "this preset charges epsilon to a ledger (privacy.ledger.required); give a file path",
        )
    if name == "dpsgd":
        check_number(cfg, "privacy.noise_multiplier", 0)
        check_number(cfg, "privacy.max_grad_norm", 0, strict=True)
        check_number(cfg, "privacy.delta", 0, 1, strict=True)
        check_number(cfg, "privacy.target_epsilon", 0, strict=True, null=True)
        check_choice(cfg, "privacy.accountant", ("rdp", "prv", "gdp"))
        check_choice(cfg, "privacy.sampling", ("poisson", "shuffle"))
        if ledger_path:
            check_choice(cfg, "privacy.ledger.scheduler", ("dpbalance", "dpf", "dpk", "fcfs"))
            check_number(cfg, "privacy.ledger.demand_epsilon", 0, strict=True)
            check_number(cfg, "privacy.ledger.block_budget", 0, strict=True)
            check_number(cfg, "privacy.ledger.beta", 0)
            check_number(cfg, "privacy.ledger.kappa_max", 1, null=True)
            check_number(cfg, "privacy.ledger.lease_s", 0, strict=True)
            check_number(cfg, "privacy.ledger.block_delta", 0, 1, strict=True)
            require(
                cfg.privacy.delta <= cfg.privacy.ledger.block_delta,
                "privacy.delta",
                cfg.privacy.delta,
                "must not exceed privacy.ledger.block_delta (the δ budget of a client's block)",
            )
        layer = _dp_incompatible_layer(cfg)
        require(layer is None, "task.model", cfg.task.model, f"Opacus cannot train {layer}")
    if name in ("dpsgd", "central"):
        check_choice(cfg, "privacy.server_dp.mode", ("none", "fixed", "adaptive"))
        if cfg.privacy.server_dp.mode != "none":
            check_number(cfg, "privacy.server_dp.noise_multiplier", 0)
            check_number(cfg, "privacy.server_dp.clipping_norm", 0, strict=True)
            check_number(cfg, "privacy.server_dp.target_clipped_quantile", 0, 1)
            check_number(cfg, "privacy.server_dp.clip_norm_lr", 0)


def _dp_incompatible_layer(cfg: DictConfig) -> str | None:
    """The first layer of the run's model that Opacus rejects (e.g. BatchNorm), or None."""
    from opacus.validators import ModuleValidator

    image = cfg.task.model in ("cnn", "lenet5", "resnet18")  # layer types ignore input size
    hidden = tuple(cfg.task.get("hidden") or (64,))
    model = build_model(cfg.task.model, (3, 32, 32) if image else (64,), 10, hidden=hidden)
    for name, module in model.named_modules():
        check = ModuleValidator.VALIDATORS.get(type(module))
        errors = check(module) if check is not None else []
        if errors:
            return f"layer {name!r} ({type(module).__name__}): {str(errors[0]).split('. ')[0]}"
    return None


def check_privacy_with_strategy(cfg: DictConfig) -> None:
    """Privacy modes that a strategy (its server half declares so) or an aggregation cannot use.

    Central DP's noise must reach every client's model and assumes each client moves the
    mean by at most C/n; DP-SGD's plan and accountant follow the run's step count.
    """
    name, privacy = cfg.strategy.name, cfg.privacy.name
    server = get_strategy(str(name)).server
    central = OmegaConf.select(cfg, "privacy.server_dp.mode", default="none") != "none"
    pair = f"invalid config: privacy={privacy} with strategy={name}"
    if central and not getattr(server, "central_dp_safe", True):
        raise ConfigError(
            f"{pair}: its clients keep model copies that central DP's noise would not reach"
        )
    if privacy == "dpsgd" and not getattr(server, "dpsgd_safe", True):
        raise ConfigError(
            f"{pair}: it sets local steps per round, which DP-SGD's plan and accountant ignore"
        )
    aggregation = OmegaConf.select(cfg, "aggregation.name", default="mean")
    require(
        not central or aggregation == "mean",
        "aggregation",
        aggregation,
        f"privacy={privacy} (central DP) needs aggregation=mean: its noise assumes the mean",
    )
