"""The local training loop; strategies change it only through `fl.hooks.ClientHooks`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fl.hooks import ClientHooks

__all__ = ["LocalResult", "TrainSettings", "train_locally"]


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


def train_locally(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    hooks: ClientHooks,
    settings: TrainSettings,
) -> LocalResult:
    """Minibatch SGD over in-memory (x, y); hooks may change every step.

    Batches are slices of a seeded permutation, not a DataLoader, so a simulated client
    costs little more than its arithmetic.
    """
    if len(y) == 0:
        raise ValueError("this client has no training data")
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=settings.lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
    )
    model.train()
    steps, samples, loss_sum = 0, 0, torch.zeros((), device=x.device)
    for step, batch in enumerate(_batches(len(y), generator, settings, hooks)):
        batch = batch.to(x.device)
        for group in optimizer.param_groups:
            group["lr"] = hooks.lr(step, settings.lr)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        hooks.before_step(model)
        optimizer.step()
        steps, samples = step + 1, samples + len(batch)
        loss_sum += loss.detach() * len(batch)
        if not hooks.after_step(steps, model, loss.detach()):
            break
    return LocalResult(steps, samples, float(loss_sum) / max(samples, 1))
