"""The training kernels the cohort and per-client paths chose, each against the form it
replaced, side by side (issue 37).

One thread, as the engine trains. Each pair runs interleaved in one process, `--repeats`
times; a ratio is the median of the repeats' ratios (CPU seconds, robust to other jobs),
printed with the machine's load and whether the two give the same values:

- class-major `log_softmax` (`clients.cohort._log_softmax`) vs `torch.log_softmax` along a
  10-wide last axis, on a 1000-client cohort step's logits (1000 × 16 × 10);
- ReLU's backward kernel (`threshold_backward`) vs a float × bool gate product, on its
  hidden layer (1000 × 16 × 32);
- `index_select` (`clients.cohort._gather`) vs advanced indexing, gathering a step's rows;
- the grouped MLP step (`clients.cohort._grouped_mlp`) as a whole, now vs the form with
  the three above undone;
- a LeNet-5 step on 32 images of 3 × 32 × 32 (the room presets' shape), channels-last
  input (`fl.world.models.conv_input`) vs the plain layout;
- `clients.cohort._trunk_autograd` for 20 such clients, channels-last vs plain.

    .venv/bin/python experiments/bench_kernels.py --repeats 7 --calls 10
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
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clients import cohort
from fl.world.models import build_model, conv_input

Pair = tuple[str, Callable[[], Any], Callable[[], Any], str]


def _cpu_s(call: Callable[[], Any], calls: int) -> float:
    """CPU seconds a call, after one untimed call (the allocator's warm-up)."""
    call()
    started = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - started) / calls


def _same(a: Any, b: Any) -> str:
    """'bit-identical', or the largest absolute difference."""
    if isinstance(a, dict):
        pairs = [(a[k], b[k]) for k in a]
    elif isinstance(a, tuple | list):
        flat_a = [x for v in a for x in (v.values() if isinstance(v, dict) else [v])]
        flat_b = [x for v in b for x in (v.values() if isinstance(v, dict) else [v])]
        pairs = list(zip(flat_a, flat_b, strict=True))
    else:
        pairs = [(a, b)]
    if all(torch.equal(x, y) for x, y in pairs):
        return "bit-identical"
    return f"max |diff| {max(float((x - y).abs().max()) for x, y in pairs):.1e}"


def _grouped_mlp_before(
    names: list[str], layers: list[nn.Module], weights: dict[str, torch.Tensor], *batch: Any
) -> Any:
    """`_grouped_mlp` with its three kernel choices undone (last-axis log_softmax, a bool
    gate, no contiguous delta): the form it replaced."""
    x, y, mask, sizes = batch
    inputs, gates, last = [], {}, ""
    for name, layer in zip(names, layers, strict=True):
        if isinstance(layer, nn.Flatten):
            x = x.flatten(2)
        elif isinstance(layer, nn.Linear):
            inputs.append((name, x))
            weight = weights[f"{name}.weight"].transpose(1, 2)
            x = torch.baddbmm(weights[f"{name}.bias"].unsqueeze(1), x, weight)
            last = name
        else:
            gates[last] = x > 0
            x = torch.relu(x)
    log_probs = torch.log_softmax(x, dim=2)
    losses = cohort._batch_losses(log_probs, y, mask, sizes)
    delta = log_probs.exp()
    delta.scatter_add_(2, y.unsqueeze(2), torch.full_like(delta[..., :1], -1.0))
    delta *= (mask / sizes[:, None]).unsqueeze(2)
    grads = {}
    for depth in range(len(inputs) - 1, -1, -1):
        name, given = inputs[depth]
        if name in gates:
            delta = delta * gates[name]
        grads[f"{name}.weight"] = torch.bmm(delta.transpose(1, 2), given)
        grads[f"{name}.bias"] = delta.sum(1)
        if depth:
            delta = torch.bmm(delta, weights[f"{name}.weight"])
    return grads, losses


def _pairs() -> list[Pair]:
    torch.manual_seed(0)
    k, batch, dim, hidden, classes = 1000, 16, 20, 32, 10
    logits = torch.randn(k, batch, classes)
    delta, out = torch.randn(k, batch, hidden), torch.relu(torch.randn(k, batch, hidden))
    gate = out > 0
    data, rows = torch.randn(k * 48, dim), torch.randint(0, k * 48, (k, batch))
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    names, layers = [n for n, _ in mlp.named_children()], list(mlp.children())
    stacked = {n: p.detach() + 0.1 * torch.randn(k, *p.shape) for n, p in mlp.named_parameters()}
    x, y = torch.randn(k, batch, dim), torch.randint(0, classes, (k, batch))
    sizes = torch.randint(1, batch + 1, (k,))
    mask = (torch.arange(batch) < sizes[:, None]).float()
    step = (x, y, mask, sizes)
    now = functools.partial(cohort._grouped_mlp, names, layers, stacked, *step)
    before = functools.partial(_grouped_mlp_before, names, layers, stacked, *step)

    lenet = build_model("lenet5", (3, 32, 32), 10)
    images, labels = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def lenet_step(inputs: torch.Tensor) -> list[torch.Tensor]:
        lenet.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(lenet(inputs), labels).backward()
        return [p.grad for p in lenet.parameters() if p.grad is not None]

    clients = 20
    trunk_w = {
        n: p.detach() + 0.01 * torch.randn(clients, *p.shape) for n, p in lenet.named_parameters()
    }
    trunk_x = torch.randn(clients, 32, 3, 32, 32)
    trunk_y = torch.randint(0, 10, (clients, 32))
    full, ones = torch.full((clients,), 32), torch.ones(clients, 32)
    trunk = cohort._gradients(lenet, trunk_pays=True)

    def trunk_plain() -> Any:
        """The trunk with `conv_input` undone (the module global it calls, swapped)."""
        cohort.conv_input = nn.Identity()
        try:
            return trunk(trunk_w, trunk_x, trunk_y, ones, full)
        finally:
            cohort.conv_input = conv_input

    return [
        (
            "log_softmax (1000×16×10)",
            lambda: cohort._log_softmax(logits),
            lambda: torch.log_softmax(logits, dim=2),
            "class-major vs last axis",
        ),
        (
            "ReLU backward (1000×16×32)",
            lambda: torch.ops.aten.threshold_backward(delta, out, 0),
            lambda: delta * gate,
            "threshold_backward vs float × bool",
        ),
        (
            "gather a step's rows (16k × 20)",
            lambda: cohort._gather(data, rows),
            lambda: data[rows],
            "index_select vs advanced indexing",
        ),
        ("grouped MLP step (1000 clients)", now, before, "now vs the three undone"),
        (
            "LeNet-5 step, 32 × 3×32×32",
            lambda: lenet_step(conv_input(images)),
            lambda: lenet_step(images),
            "channels-last vs plain input",
        ),
        (
            "conv trunk, 20 LeNet-5 clients",
            lambda: trunk(trunk_w, trunk_x, trunk_y, ones, full),
            trunk_plain,
            "channels-last vs plain",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10, help="calls timed per repeat and arm")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load (1, 5, 15 min) at start: {os.getloadavg()}")
    print(
        "| kernel | ours vs before | ours ms (CPU, median) | before ms | ours / before | values |"
    )
    print("|---|---|---|---|---|---|")
    for label, ours, before, what in _pairs():
        same = _same(ours(), before())
        times: dict[str, list[float]] = {"ours": [], "before": []}
        for _ in range(args.repeats):
            for arm, call in (("ours", ours), ("before", before)):
                times[arm].append(_cpu_s(call, args.calls))
        ratio = statistics.median(
            a / b for a, b in zip(times["ours"], times["before"], strict=True)
        )
        mine, theirs = (1000 * statistics.median(times[a]) for a in ("ours", "before"))
        print(f"| {label} | {what} | {mine:.3f} | {theirs:.3f} | {ratio:.2f}× | {same} |")
    print(f"load (1, 5, 15 min) at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
