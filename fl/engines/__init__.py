"""Engines that run the very same ServerApp and ClientApp: local, flower-sim, deployment."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

__all__ = ["run_engine"]


def run_engine(cfg: DictConfig, run_config: dict[str, Any]) -> None:
    """Run the configured engine to the end of training."""
    name = cfg.engine.name
    if name == "local":
        from fl.engines.local import run_local

        run_local(cfg, run_config)
    elif name == "flower-sim":
        from fl.engines.simulation import run_flower_simulation

        run_flower_simulation(cfg, run_config)
    elif name == "deployment":
        from fl.engines.deployment import submit_to_superlink

        submit_to_superlink(cfg)
    else:
        raise ValueError(f"unknown engine {name!r}")
