"""Why does APF freeze little on digits? Measure how much per-round updates zig-zag.

Runs FedAvg on the local engine, keeps the global model of every round, and reports for
the last `--window` rounds: how often a scalar's update flips sign from one round to
the next, APF's window-form effective perturbation P (S-APF-J eq. 1-2), and the share of
scalars APF would call stable (P < T_s). Scalars that converge smoothly have P near 1
and never freeze, whatever the threshold; zig-zagging ones have P near 0.

    .venv/bin/python experiments/apf_stability_probe.py lr=0.05 rounds=300 local_steps=10
"""

from __future__ import annotations

import sys

import torch

from fl.common.config import compose, to_run_config
from fl.run.engines.local import run_local
from fl.run.validation import validate
from fl.strategy.client import ClientHooks
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy
from strategies.fedavg import FedAvgParams

HISTORY: list[torch.Tensor] = []


class RecordingFedAvg(ServerStrategy):
    """FedAvg that keeps every round's global vector."""

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        vector = super().aggregate(server_round, updates)
        HISTORY.append(vector.clone())
        return vector


register("fedavg_recording", server=RecordingFedAvg, client=ClientHooks, params=FedAvgParams)


def report(history: list[torch.Tensor], window: int, threshold: float) -> dict[str, float]:
    """Sign-flip rate and window-form perturbation over the last `window` rounds."""
    x = torch.stack(history[-(window + 1) :])
    updates = x[1:] - x[:-1]
    moving = updates.abs().sum(0) > 0
    flips = (updates[1:] * updates[:-1] < 0).float().mean(0)
    p = updates.sum(0).abs() / updates.abs().sum(0).clamp_min(1e-30)
    p = p[moving]
    return {
        "scalars that moved": float(moving.float().mean()),
        "mean sign-flip rate": float(flips[moving].mean()),
        "median P": float(p.median()),
        f"share P < {threshold}": float((p < threshold).float().mean()),
        "share P < 0.2": float((p < 0.2).float().mean()),
        "share P > 0.8": float((p > 0.8).float().mean()),
    }


def main(overrides: list[str]) -> None:
    cfg = compose(["strategy=fedavg", "progress=false", "output_dir=/tmp/apf_probe", *overrides])
    cfg.strategy.name = "fedavg_recording"
    validate(cfg)
    run_local(cfg, to_run_config(cfg))
    window = min(100, len(HISTORY) - 1)
    print(f"over the last {window} rounds ({' '.join(overrides)}):")
    for key, value in report(HISTORY, window, 0.05).items():
        print(f"  {key:>22}: {value:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
