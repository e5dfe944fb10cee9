"""Cohort training in one process: the plain loop, the per-client trainer and the cohort.

Times one round of one epoch of batch-16 SGD over `--clients` clients of a task (each from
the same starting weights, each with its own shuffle seed), three ways on one device:

- `plain`: `experiments/bench_many_clients.train_one_client` for each client in turn;
- `per_client`: `clients.trainer.train_locally` for each client in turn (our per-client path);
- `cohort`: `clients.cohort.train_cohort`, every client at once (host data, moved in one
  transfer);
- `cohort_vmap` (conv tasks only): the same with `vmap` forced (the reference where the
  per-client conv trunk is taken, `clients.cohort.TRUNK_MIN_PIXELS`).

It reports median seconds per round over `--repeats` (arms alternate within a repeat), the
machine's load, how much of `STEP_TOLERANCE` the cohort used per weight against the
per-client trainer (≤ 1: within it; a ReLU or max-pool tie that flips can exceed it for a
few weights) and its drift in norm (`DRIFT_TOLERANCE`). No messages, no server: the
figure of the training itself.
`experiments/gpu_check.py` runs it on CUDA; the CNN figure of issue 30 is

    .venv/bin/python experiments/bench_cohort.py --task shapes --clients 200

(LeNet-5 on `task=shapes`), and the MLP one `--task synthetic --clients 1000`; the room
presets' 32×32 shapes (issue 35) `--task shapes32 --clients 20`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.bench_many_clients import (
    BATCH_SIZE,
    DIM,
    HIDDEN,
    LOCAL_EPOCHS,
    NUM_CLASSES,
    SAMPLES_PER_DEVICE,
    client_seed,
    config_lr,
    train_one_client,
)
from fl.common.files import write_atomic

# The many-client benchmark's workload, and LeNet-5 on generated shapes (Dirichlet split).
SYNTHETIC = [
    "task=synthetic",
    "partition=natural",
    f"task.hidden=[{','.join(map(str, HIDDEN))}]",
    f"task.options.dim={DIM}",
    f"task.options.num_classes={NUM_CLASSES}",
    f"task.options.samples_per_device={SAMPLES_PER_DEVICE}",
]
SHAPES = ["task=shapes", "partition=iid"]
TASKS = {"synthetic": SYNTHETIC, "shapes": SHAPES, "shapes32": [*SHAPES, "task.options.size=32"]}


def compare(
    task: list[str], clients: int, device: str, repeats: int = 3, vmap_arm: bool = False
) -> dict[str, Any]:
    """Median seconds per round of the three arms on `device` (and `cohort_vmap` with
    `vmap_arm`), and the cohort's drift."""
    from clients import cohort as cohort_module
    from clients.cohort import STEP_TOLERANCE, Member, train_cohort
    from clients.trainer import TrainSettings, train_locally
    from fl.common.config import compose
    from fl.strategy.client import ClientHooks
    from fl.world.task import get_task

    torch.set_num_threads(1)  # as the engine (torch_threads=1)
    cfg = compose([*task, f"num_clients={clients}"])
    built = get_task(cfg)
    target = torch.device(device)
    model = built.new_model().to(target)
    layout = built.layout
    start, lr = layout.read(model), config_lr()
    shards = [(p, *(t.cpu() for t in built.client_data(p))) for p in range(clients)]
    on_device = [(p, x.to(target), y.to(target)) for p, x, y in shards]

    def settings(partition: int) -> TrainSettings:
        return TrainSettings(0, LOCAL_EPOCHS, BATCH_SIZE, lr, seed=client_seed(1, partition))

    def sync() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    def plain() -> None:
        for p, x, y in on_device:
            layout.load_into(model, start)
            train_one_client(model, x, y, lr, 1, p)

    alone: list[torch.Tensor] = []

    def per_client() -> None:
        alone.clear()
        for p, x, y in on_device:
            layout.load_into(model, start)
            train_locally(model, x, y, ClientHooks(None), settings(p))
            alone.append(layout.read(model))

    together: list[Any] = []

    def cohort() -> None:
        members = [Member(start, x, y, ClientHooks(None), settings(p)) for p, x, y in shards]
        together[:] = train_cohort(model, layout, members, target)

    def cohort_vmap() -> None:
        members = [Member(start, x, y, ClientHooks(None), settings(p)) for p, x, y in shards]
        chosen = cohort_module._trunk_pays
        cohort_module._trunk_pays = lambda x, batch_size: False  # type: ignore[assignment]
        try:
            train_cohort(model, layout, members, target)
        finally:
            cohort_module._trunk_pays = chosen

    arms = [("plain", plain), ("per_client", per_client), ("cohort", cohort)]
    if vmap_arm:
        arms.append(("cohort_vmap", cohort_vmap))
    seconds: dict[str, list[float]] = {name: [] for name, _ in arms}
    load1 = os.getloadavg()[0]
    for _ in range(repeats):
        for name, arm in arms:  # alternating, so drift of the machine hits every arm alike
            sync()
            started = time.perf_counter()
            arm()
            sync()
            seconds[name].append(time.perf_counter() - started)
    trained, results = together
    reference = torch.stack(alone)
    bound = STEP_TOLERANCE["atol"] + STEP_TOLERANCE["rtol"] * reference.abs()
    steps = torch.tensor([r.steps for r in results], dtype=torch.float32)[:, None]
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "task": " ".join(task),
        "model": built.model_name,
        "device": torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu",
        "clients": clients,
        "steps": int(steps.sum()),
        "round_s": medians,
        "round_s_all": seconds,
        "cohort_vs_plain": medians["cohort"] / medians["plain"],
        "cohort_vs_per_client": medians["cohort"] / medians["per_client"],
        "cohort_vmap_vs_plain": medians["cohort_vmap"] / medians["plain"] if vmap_arm else None,
        "tolerance_used": float(((trained - reference).abs() / (steps * bound)).max()),
        # max over clients of ‖w_cohort − w_alone‖ / ‖w_alone − w_start‖ (≤ DRIFT_TOLERANCE)
        "drift": float(((trained - reference).norm(dim=1) / (reference - start).norm(dim=1)).max()),
        "load1": [load1, os.getloadavg()[0]],  # at start and at end
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="synthetic")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    vmap_arm = args.task != "synthetic"  # the MLP never takes vmap: nothing to compare
    result = compare(TASKS[args.task], args.clients, args.device, args.repeats, vmap_arm)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, text + "\n")


if __name__ == "__main__":
    main()
