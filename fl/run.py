"""`fl-run`: the Hydra entry point (also `python -m fl.run`).

Composes and validates the config, pins the output directory, then hands the resolved
config to the chosen engine, which runs our ServerApp and ClientApp.
"""

from __future__ import annotations

import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import fl  # noqa: F401  (sets the offline environment before Flower is imported)
from fl.config import CONF_DIR, ConfigError, to_run_config, validate
from fl.engines import run_engine

__all__ = ["main"]

log = logging.getLogger(__name__)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
    except ConfigError as err:
        raise SystemExit(f"fl-run: {err}") from None
    with open_dict(cfg):
        cfg.output_dir = HydraConfig.get().runtime.output_dir
    run_engine(cfg, to_run_config(cfg))


def main() -> None:
    """Console-script entry point."""
    _main()


if __name__ == "__main__":
    main()
