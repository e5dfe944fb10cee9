"""Loading and reading a client's model: `Layout.bind` (one copy) vs per-tensor copies.

Side by side in one process, on the models a simulated client uses: the population
benchmark's MLP 20-32-2 (`bench_scale.py`) and LeNet-5 on 3×32×32 images. Per model,
medians over `--repeats` of the mean of `--calls` calls, each in µs:

- load: plain PyTorch `load_state_dict`; `Layout.load_into` on an unbound model (one
  `copy_` per tensor); the same on a bound model (one copy of the flat vector);
- read: plain PyTorch `torch.cat` of the `state_dict`; `Layout.flatten(state_dict())`; the
  bound model's `Layout.read`.

    .venv/bin/python experiments/bench_layout.py [--calls 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl.wire.records import Layout
from fl.world.models import build_model

MODELS = {  # name: (builder, input shape, classes, options)
    "mlp 20-32-2": ("mlp", (20,), 2, {"hidden": (32,)}),
    "lenet5": ("lenet5", (3, 32, 32), 10, {}),
}


def _us(call: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over repeats of the mean time of one call, in µs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def bench(name: str, calls: int, repeats: int) -> list[str]:
    kind, shape, classes, options = MODELS[name]
    torch.manual_seed(0)
    plain, bound = (build_model(kind, shape, classes, **options) for _ in range(2))
    layout = Layout.of(plain.state_dict())
    layout.bind(bound)
    vector = torch.randn(layout.numel)
    state = layout.unflatten(vector)
    rows = {
        "load": (
            lambda: plain.load_state_dict(state),
            lambda: layout.load_into(plain, vector),
            lambda: layout.load_into(bound, vector),
        ),
        "read": (
            lambda: torch.cat([t.reshape(-1) for t in plain.state_dict().values()]),
            lambda: layout.flatten(plain.state_dict()),
            lambda: layout.read(bound),
        ),
    }
    lines = []
    for op, (reference, unbound, one_copy) in rows.items():
        us = [_us(f, calls, repeats) for f in (reference, unbound, one_copy)]
        lines.append(
            f"| {name} ({layout.numel} scalars) | {op} | {us[0]:.1f} | {us[1]:.1f} | {us[2]:.1f} "
            f"| {us[0] / us[2]:.1f}× | {us[1] / us[2]:.1f}× |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the engine's torch_threads=1
    head = ["model", "op", "plain PyTorch µs", "per tensor µs", "bound µs"]
    print("| " + " | ".join([*head, "plain ÷ bound", "per tensor ÷ bound"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for name in MODELS:
        for line in bench(name, args.calls, args.repeats):
            print(line)


if __name__ == "__main__":
    main()
