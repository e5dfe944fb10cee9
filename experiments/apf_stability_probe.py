"""Why does APF freeze little on digits? Measure how much per-round updates zig-zag.

Runs FedAvg on the local engine, keeps the global model of every round, and reports for
the last `--window` rounds: how often a scalar's update flips sign from one round to
the next, APF's window-form effective perturbation P (S-APF-J eq. 1-2), and the share of
scalars APF would call stable (P < T_s). Scalars that converge smoothly have P near 1
and never freeze, whatever the threshold; zig-zagging ones have P near 0.

    .venv/bin/python experiments/apf_stability_probe.py lr=0.05 rounds=300 local_steps=10
    .venv/bin/python experiments/apf_stability_probe.py --window 50 --out DIR rounds=100

Its run's files go to a new temporary folder unless `--out DIR` (a new folder) is given.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from fl.api import (
    ClientHooks,
    ClientUpdate,
    ServerStrategy,
    compose,
    register,
    run_local,
    to_run_config,
    validate,
)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=100, help="rounds reported (last N)")
    parser.add_argument("--out", help="a new folder for the run's files (default: a temp one)")
    parser.add_argument("overrides", nargs="*", help="fl-run overrides, e.g. lr=0.05 rounds=300")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="apf_probe-")
    cfg = compose(["strategy=fedavg", "progress=false", f"output_dir={out}", *args.overrides])
    cfg.strategy.name = "fedavg_recording"
    validate(cfg)
    run_local(cfg, to_run_config(cfg))
    window = min(args.window, len(HISTORY) - 1)
    print(f"over the last {window} rounds ({' '.join(args.overrides)}):")
    for key, value in report(HISTORY, window, 0.05).items():
        print(f"  {key:>22}: {value:.3f}")


if __name__ == "__main__":
    main()
