"""A strategy's client half around your own model, optimizer and data, in any ClientApp.

```python
@app.train()
def train(msg, context):
    return train_with_hooks(msg, context, model, optimizer, loader, strategy="apf")
```

One call does what our ClientApp does for a round: refuses an instruction meant for
another strategy (`fl.wire.contract`), loads the server's payload into `model` through the
strategy's `load` hook (APF's synced model and mask), then trains: per batch the `lr`
hook, forward, backward, `before_step` (FedProx's proximal term), `optimizer.step()` and
`after_step` (APF's roll-back of frozen scalars, an early stop). The `end` hook encodes
the reply (APF's masked payload) and the reply carries the metrics our server checks:
`num-examples`, `train-loss`, `steps`, `samples`. The loader decides batch sizes: a
strategy's `batch_size` hook does not apply here. Per-node memory lives in
`context.state`, as in our own ClientApp.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from fl.strategy.client import ClientTime, load_instruction
from fl.strategy.registry import get_strategy
from fl.wire.codec import payload_traffic
from fl.wire.contract import echo, mismatch_reply
from fl.wire.records import Layout, required_record

__all__ = ["train_with_hooks"]

Batch = tuple[torch.Tensor, torch.Tensor]


def train_with_hooks(
    msg: Message,
    context: Context,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable[Batch],
    *,
    strategy: str,
    params: Mapping[str, Any] | None = None,
    epochs: int = 1,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> Message:
    """Train `model` for one round under `strategy`'s client hooks; the reply to `msg`.

    `params` are the strategy's hyper-parameters (as in `conf/strategy/NAME.yaml`); the
    server's `local-epochs` / `local-steps` / `lr` keys, when sent, override `epochs` and
    the optimizer's learning rate for this round.
    """
    spec = get_strategy(strategy)
    config = required_record(msg.content, "config", ConfigRecord)
    refusal = mismatch_reply(msg, config, spec.name)
    if refusal is not None:
        return refusal
    hooks = spec.client(spec.make_params(dict(params or {})))
    layout = Layout.of(model.state_dict())
    hooks.time = ClientTime.from_config(config, payload_traffic(msg.content).total)
    load_instruction(hooks, spec.name, model, msg.content, config, context.state, layout)
    hooks.begin(model, config, context.state)
    steps_cap = int(cast(int, config.get("local-steps", 0)))  # > 0: exactly this many
    epochs = int(cast(int, config.get("local-epochs", epochs)))
    original = [group["lr"] for group in optimizer.param_groups]  # given back at the end
    base_lr = float(cast(float, config.get("lr", original[0])))
    model.train()
    steps = samples = 0
    loss_sum = 0.0
    for x, y in _batches(loader, epochs, steps_cap):
        lr = hooks.lr(steps, base_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        hooks.before_step(model)
        optimizer.step()
        steps, samples = steps + 1, samples + len(y)
        hooks.time.samples = samples
        loss_sum += float(loss.detach()) * len(y)
        if not hooks.after_step(steps, model, loss.detach()):
            break
    for group, lr in zip(optimizer.param_groups, original, strict=True):
        group["lr"] = lr
    if steps == 0:
        raise ValueError("train_with_hooks: the loader yielded no batch")
    records, extra = hooks.end(model, context.state, layout)
    dataset = getattr(loader, "dataset", None)
    examples = len(dataset) if dataset is not None else samples
    metrics = MetricRecord(
        {
            "num-examples": examples,
            "train-loss": loss_sum / samples,
            "steps": steps,
            "samples": samples,
            **extra,
            **echo(config),
        }
    )
    return Message(RecordDict({**records, "metrics": metrics}), reply_to=msg)


def _batches(loader: Iterable[Batch], epochs: int, steps: int) -> Iterator[Batch]:
    """`steps` batches (cycling through the loader) when > 0, else `epochs` passes."""
    if steps <= 0:
        for _ in range(epochs):
            yield from loader
        return
    yield from itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), steps)
