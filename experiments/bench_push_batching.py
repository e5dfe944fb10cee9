"""Would training an R2SP cycle's pushes as one batch make `r2sp_room` affordable on CPU?

In R2SP every group's push is one SGD step of batch 32 on a model pulled before the cycle's
other pushes land, so a cycle of G pushes could be computed together. This times, in plain
PyTorch on LeNet-5 (3×32×32, the `r2sp_room` model) and the same random inputs, the
gradients of G = 16 such pushes three ways, alternately: one after another (what the loop
does today), as one batch of 16·32 (a lower bound for any batching: one weight set), and
with `torch.func.vmap` over 16 weight sets (what per-client base weights need). Medians,
the ratios to the first way, and the machine's load.

    .venv/bin/python experiments/bench_push_batching.py --repeats 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fl.common.files import write_atomic
from fl.world.models import build_model

PUSHES, BATCH = 16, 32


def ways(model: torch.nn.Module) -> dict[str, Callable[[], object]]:
    """The three ways to compute a cycle's 16 gradients, on fixed inputs."""
    x = torch.randn(PUSHES, BATCH, 3, 32, 32)
    y = torch.randint(0, 10, (PUSHES, BATCH))
    params = {name: p.detach() for name, p in model.named_parameters()}
    stacked = {name: p.expand(PUSHES, *p.shape).clone() for name, p in params.items()}

    def one_after_another() -> None:
        for push in range(PUSHES):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[push]), y[push]).backward()

    def one_batch() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.flatten(0, 1)), y.flatten()).backward()

    def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xb,)), yb)

    per_push = vmap(grad(loss))
    return {
        "one_after_another": one_after_another,
        "one_batch": one_batch,
        "vmap_weight_sets": lambda: per_push(stacked, x, y),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model("lenet5", (3, 32, 32), 10, hidden=(120, 84))
    arms = ways(model)
    for run in arms.values():  # one-time costs (kernels, vmap's tracing) before any timer
        run()
    times: dict[str, list[float]] = {name: [] for name in arms}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, run in arms.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    loads.append(os.getloadavg()[0])
    median = {name: statistics.median(values) for name, values in times.items()}
    base = median["one_after_another"]
    for name, value in median.items():
        print(
            f"{name:18s} {value * 1e3:7.1f} ms a cycle of {PUSHES} pushes "
            f"({value / PUSHES * 1e3:.1f} ms a push), speed-up {base / value:.2f}x"
        )
    print(f"torch threads {torch.get_num_threads()}, load {loads}")
    if args.json:
        out = {"median_s": median, "threads": torch.get_num_threads(), "load_1min": loads}
        write_atomic(args.json, json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
