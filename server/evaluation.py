"""Central evaluation of the global model on the task's held-out test split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from fl.wire.records import torch_state
from fl.world.models import conv_input
from fl.world.task import Task

__all__ = ["evaluate_global"]


@torch.no_grad()
def evaluate_global(task: Task, arrays: ArrayRecord, batch_size: int = 2048) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of `arrays` on the test split, in batches."""
    model = task.model()
    model.load_state_dict(torch_state(arrays))
    model.eval()
    x_all, y_all = task.dataset.x_test, task.dataset.y_test
    correct, loss_sum = 0, 0.0
    for start in range(0, len(y_all), batch_size):
        x = x_all[start : start + batch_size].to(task.device)
        y = y_all[start : start + batch_size].to(task.device)
        logits = model(conv_input(x))
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    return correct / len(y_all), loss_sum / len(y_all)
