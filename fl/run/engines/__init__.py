"""Engines that run the very same ServerApp and ClientApp: local, flower-sim, deployment."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from fl.common.config import check_choice, check_int, check_number, require
from fl.net.tls import is_allowlist
from fl.run.apps import Apps

__all__ = ["ENGINES", "check_engine", "run_engine"]

ENGINES = ("local", "flower-sim", "deployment")
COHORT_CHOICES = ("auto", "off")  # engine.cohort of the local and flower-sim engines


def run_engine(cfg: DictConfig, run_config: dict[str, Any], apps: Apps | None = None) -> None:
    """Run `apps` (default: the project's own) on the configured engine to the end of
    training (deployment submits the project's App to a SuperLink, whose nodes load the
    apps by their references)."""
    apps = apps or Apps.load()
    name = cfg.engine.name
    if name == "local":
        from fl.run.engines.local import run_local

        run_local(cfg, run_config, apps)
    elif name == "flower-sim":
        from fl.run.engines.simulation import run_flower_simulation

        run_flower_simulation(cfg, run_config, apps)
    elif name == "deployment":
        from fl.run.engines.deployment import submit_to_superlink

        submit_to_superlink(cfg)
    else:
        raise ValueError(f"unknown engine {name!r}")


def check_engine(cfg: DictConfig) -> None:
    """`engine.name` and the options of that engine."""
    check_choice(cfg, "engine.name", ENGINES)
    if cfg.engine.name == "local":
        check_int(cfg, "engine.workers", 1)
        check_number(cfg, "engine.state_memory_mb", 0)
        if OmegaConf.select(cfg, "engine.cohort") is not None:  # absent in older runs: off
            check_choice(cfg, "engine.cohort", COHORT_CHOICES)
    if cfg.engine.name == "deployment":
        check_number(cfg, "engine.node_wait_s", 0)
        allowed = OmegaConf.select(cfg, "engine.allowed_nodes")
        listed = OmegaConf.to_container(allowed) if isinstance(allowed, ListConfig) else allowed
        require(
            allowed is None or is_allowlist(listed),
            "engine.allowed_nodes",
            listed,
            "must be null or a non-empty list of node ids and SHA256:… key fingerprints",
        )
    if cfg.engine.name == "flower-sim":
        check_number(cfg, "engine.num_cpus_per_client", 0)
        check_number(cfg, "engine.num_gpus_per_client", 0)
        if OmegaConf.select(cfg, "engine.cohort") is not None:  # absent in older runs: off
            check_choice(cfg, "engine.cohort", COHORT_CHOICES)
            check_int(cfg, "engine.cohorts", 1)
