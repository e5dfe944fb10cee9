"""Self-checks of the cluster client: real ranks against one process (`fl-cluster-client check`).

`cluster_check` runs a real cluster round (rank 0 here, workers as processes on loopback,
`clients.ranks.run_cluster_round`) with unequal per-rank shares and compares the first
step's gradient and the final weights with `clients.trainer.train_locally` on the same
data, seed and initial weights; `gpu_cluster_check` does the same on CUDA with NCCL (or,
with one GPU, gloo ranks on CUDA tensors plus a one-rank NCCL all-reduce). They sit apart
from the rank machinery they test, and below `clients.cluster`, whose command line
(`check`, `gpu-check`) and `experiments/gpu_check.py` call them.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clients.ranks import JOIN_TIMEOUT, ClusterConfig, Instruction, run_cluster_round
from clients.trainer import TrainSettings
from fl.common.seeding import derive_seed
from fl.mechanisms.lbbsp import proportional_sizes
from fl.strategy.client import ClientHooks
from fl.world.task import get_task

__all__ = ["cluster_check", "gpu_cluster_check"]


class _GradientProbe(ClientHooks):
    """Keeps the gradient of the first step, as the optimizer sees it."""

    first: torch.Tensor | None = None

    def before_step(self, model: nn.Module) -> None:
        if self.first is None:
            grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
            self.first = torch.cat(grads).detach().to("cpu", torch.float64)


def cluster_check(
    ranks: int = 2, backend: str = "gloo", device: str = "cpu", steps: int = 4, batch: int = 96
) -> dict[str, Any]:
    """Real ranks against one process: the first step's gradient and the weights after
    `steps` steps with unequal shares (per-rank caps force them, e.g. 72 + 24 of 96).

    The ranks are processes on this machine (rank 0 here), on loopback; the reference is
    `clients.trainer.train_locally` on the same data, seed and initial weights.
    """
    from clients.trainer import train_locally
    from fl.common.config import compose, to_run_config

    cfg = compose(["partition=iid", "num_clients=2", f"batch_size={batch}", f"local_steps={steps}"])
    task = get_task(cfg)
    caps = tuple(proportional_sizes([float(ranks - r) for r in range(ranks)], batch))
    config = ClusterConfig(ranks, backend, "gpu", "ema", device=device, caps=caps)
    settings = TrainSettings(steps, 0, batch, float(cfg.lr), seed=derive_seed(cfg.seed, 1, 0))
    data = task.client_data(0)
    start = task.new_model()
    reference, model = task.new_model(), task.new_model()
    reference.load_state_dict(start.state_dict())
    model.load_state_dict(start.state_dict())
    alone, together = _GradientProbe(None), _GradientProbe(None)
    instruction = Instruction(to_run_config(cfg), 0, asdict(settings), (), device)
    started = time.perf_counter()
    result, shares = run_cluster_round(config, model, data, instruction, together)
    wall_s = time.perf_counter() - started
    train_locally(reference, *data, alone, settings)
    assert alone.first is not None and together.first is not None
    weights = [
        float((a.double() - b.double()).abs().max())
        for a, b in zip(reference.state_dict().values(), model.state_dict().values(), strict=True)
    ]
    return {
        "ranks": ranks,
        "backend": backend,
        "device": device,
        "shares": shares,
        "steps": result.steps,
        "grad_norm": float(alone.first.norm()),
        "grad_max_abs_diff": float((alone.first - together.first).abs().max()),
        "weights_max_abs_diff": max(weights),
        "wall_s": wall_s,
    }


def _nccl_smoke() -> dict[str, Any]:
    """NCCL with one rank on GPU 0: an all-reduce of CUDA tensors (one GPU allows no more)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False
    )
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device(0))
    try:
        tensor = torch.arange(4, dtype=torch.float32, device="cuda")
        dist.all_reduce(tensor)
        return {"nccl_one_rank_allreduce_ok": tensor.tolist() == [0.0, 1.0, 2.0, 3.0]}
    finally:
        dist.destroy_process_group()


def gpu_cluster_check() -> dict[str, Any]:
    """The cluster client on CUDA: NCCL ranks on ≥ 2 GPUs, else gloo ranks on CUDA tensors
    plus a one-rank NCCL all-reduce; {"skipped": why} without CUDA."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the NCCL cluster-client check needs a GPU"}
    gpus = torch.cuda.device_count()
    out: dict[str, Any] = {"gpus": gpus, "nccl_version": list(torch.cuda.nccl.version())}
    if gpus >= 2:
        out["nccl"] = cluster_check(min(gpus, 4), "nccl", "cuda")
    else:
        out["nccl"] = _nccl_smoke()
        out["gloo_cuda"] = cluster_check(2, "gloo", "cuda")
    return out
