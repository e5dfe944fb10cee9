"""The local training loop; strategies change it only through `fl.strategy.client.ClientHooks`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from clients.optimizers import OptimizerState, make_optimizer
from fl.strategy.client import ClientHooks
from fl.world.models import conv_input

__all__ = ["LocalResult", "Privatizer", "TrainSettings", "train_locally"]


@dataclass(frozen=True)
class TrainSettings:
    """How long and how fast one client trains in one round."""

    local_steps: int  # > 0: exactly this many steps; 0: `local_epochs` passes over the data
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    optimizer: str = "sgd"  # sgd | momentum | adam | adamw (clients.optimizers)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam's
    eps: float = 1e-8  # Adam's


class Privatizer(Protocol):
    """Differentially private training (privacy.dpsgd.PrivateTraining implements it)."""

    def attach(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, before_step: Callable[[], None]
    ) -> torch.optim.Optimizer: ...

    def batches(self, n: int, generator: torch.Generator) -> Iterator[torch.Tensor] | None: ...

    def detach(self) -> None: ...


@dataclass(frozen=True)
class LocalResult:
    """What local training did: steps taken, samples processed, mean loss."""

    steps: int
    samples: int
    mean_loss: float


def _batches(
    n: int, generator: torch.Generator, settings: TrainSettings, hooks: ClientHooks
) -> Iterator[torch.Tensor]:
    """Index batches of a seeded shuffle: `local_steps` of them, or `local_epochs` passes."""
    step = 0
    for epoch in itertools.count():
        if settings.local_steps == 0 and epoch == settings.local_epochs:
            return
        order, cursor = torch.randperm(n, generator=generator), 0
        while cursor < n:
            if settings.local_steps and step == settings.local_steps:
                return
            size = hooks.batch_size(step, settings.batch_size)
            yield order[cursor : cursor + size]
            cursor, step = cursor + size, step + 1


def _as_given(x: torch.Tensor) -> torch.Tensor:
    return x


def train_locally(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    hooks: ClientHooks,
    settings: TrainSettings,
    private: Privatizer | None = None,
    memory: OptimizerState | None = None,
) -> LocalResult:
    """Minibatch training over in-memory (x, y); hooks may change every step.

    Batches are slices of a seeded permutation, not a DataLoader, so a simulated client
    costs little more than its arithmetic. With `private`, the optimizer clips and noises
    per-sample gradients and batches may be Poisson samples (possibly empty). `memory`, the
    client's optimizer state from its earlier rounds (`clients.optimizers`), is restored
    into the optimizer first and updated in place at the end.
    """
    if len(y) == 0:
        raise ValueError("this client has no training data")
    generator = torch.Generator().manual_seed(settings.seed)
    params = list(model.parameters())
    optimizer = base = make_optimizer(
        params,
        settings.optimizer,
        settings.lr,
        settings.momentum,
        settings.weight_decay,
        settings.betas,
        settings.eps,
    )
    if memory is not None:
        memory.restore(base, params)
    batches = _batches(len(y), generator, settings, hooks)
    if private is not None:
        optimizer = private.attach(model, optimizer, lambda: hooks.before_step(model))
        batches = private.batches(len(y), generator) or batches
    model.train()
    steps, samples, loss_sum = 0, 0, torch.zeros((), device=x.device)
    current_lr = settings.lr
    on_cpu = x.device.type == "cpu"  # where the index batches are made
    # channels-last images (fl.world.models.conv_input), except for Opacus's per-sample hooks
    inputs = conv_input if private is None else _as_given
    try:
        for step, batch in enumerate(batches):
            if not on_cpu:
                batch = batch.to(x.device)
            size = len(batch)
            lr = hooks.lr(step, settings.lr)
            if lr != current_lr:  # touch the optimizer only when a strategy changes it
                for group in optimizer.param_groups:
                    group["lr"] = current_lr = lr
            optimizer.zero_grad(set_to_none=True)
            # the batch mean, and 0 (not NaN) for an empty Poisson batch; "mean" gives the
            # bits of sum / len at two thirds of the cost (one autograd node less)
            logits, targets = model(inputs(x[batch])), y[batch]
            if size:
                loss = F.cross_entropy(logits, targets)
            else:
                loss = F.cross_entropy(logits, targets, reduction="sum")
            loss.backward()
            if private is None:  # under DP-SGD the optimizer calls it on the noised gradient
                hooks.before_step(model)
            optimizer.step()
            steps, samples = step + 1, samples + size
            hooks.time.samples = samples
            detached = loss.detach()
            loss_sum.add_(detached, alpha=size)
            if not hooks.after_step(steps, model, detached):
                break
    finally:
        if private is not None:
            private.detach()
    if memory is not None:
        memory.keep(base, params, steps)
    return LocalResult(steps, samples, float(loss_sum) / max(samples, 1))
