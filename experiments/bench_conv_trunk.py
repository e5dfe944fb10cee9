"""Forward and backward of K stacked conv-net clients: `vmap`, a per-client loop, the trunk.

The reference for `clients.cohort.TRUNK_MIN_PIXELS`. One step's gradients of K clients'
models, three ways, on the CPU with one thread (as the engine runs): `vmap` over
`functional_call` (grouped convs), the plain loop (each client's model alone), and
`clients.cohort._trunk_autograd` (the conv trunk per client, the head as grouped matmuls).
Prints the median milliseconds of 5 calls, two passes, and the trunk's largest difference
from `vmap`'s gradients.

    .venv/bin/python experiments/bench_conv_trunk.py --size 32 --clients 20 --batch 32
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _median_ms(step: Callable[[], object], calls: int = 5) -> float:
    step()  # warm-up
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    from clients.cohort import _gradients, _vmap_autograd
    from fl.world.models import build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("lenet5", "cnn"), default="lenet5")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model, (3, args.size, args.size), 10)
    k, b = args.clients, args.batch
    x = torch.randn(k, b, 3, args.size, args.size)
    y = torch.randint(0, 10, (k, b))
    mask, sizes = torch.ones(k, b), torch.full((k,), float(b))
    weights = {n: p.detach().expand(k, *p.shape).clone() for n, p in model.named_parameters()}
    trunk = _gradients(model, True)
    if trunk.func is _vmap_autograd:  # type: ignore[attr-defined]
        raise SystemExit(f"{args.model} has no conv trunk")
    batched = functools.partial(_vmap_autograd, vmap(functools.partial(functional_call, model)))

    def loop() -> None:
        for client in range(k):
            model.zero_grad()
            nn.functional.cross_entropy(model(x[client]), y[client]).backward()

    grads_trunk, _ = trunk(weights, x, y, mask, sizes)
    grads_vmap, _ = batched(weights, x, y, mask, sizes)
    diff = max(float((grads_trunk[n] - grads_vmap[n]).abs().max()) for n in grads_vmap)
    print(
        f"{args.model} {args.size}x{args.size}, {k} clients, batch {b}: pixels a client "
        f"batch {b * args.size**2}; load {os.getloadavg()[0]:.2f}; max |grad diff| {diff:.1e}"
    )
    arms = {
        "vmap": lambda: batched(weights, x, y, mask, sizes),
        "loop": loop,
        "trunk": lambda: trunk(weights, x, y, mask, sizes),
    }
    for _ in range(2):
        print("  ".join(f"{name} {_median_ms(arm):.1f} ms" for name, arm in arms.items()))


if __name__ == "__main__":
    main()
