"""Cohort training: K clients of one model architecture trained as one batched program.

`clients.trainer.train_locally` trains one client at a time; for a small model a step is
a few hundred FLOPs per sample and its cost is dispatch, not arithmetic. Here the K
clients' weights are stacked on a leading client axis and every step is one call of
`torch.func.vmap` over `torch.func.functional_call` (the forward of every client at
once), one backward of the sum of the clients' losses (independent clients: each gets its
own gradient) and one batched SGD update. (Not `torch.func.grad`: it imports
torch._dynamo, 1.5–2 s, on first use, and costs more per call.) What each client would
have done alone is kept:

- **Its batches.** Each client's index batches come from `clients.trainer._batches` with
  a generator seeded by its own `TrainSettings.seed`: the very batches the per-client path
  draws, its `batch_size` hook included. Ragged batches (a client's last one, LB-BSP-like
  sizes) are padded and masked: padded rows weigh 0 and the loss is divided by the
  client's own batch size, as `F.cross_entropy`'s mean is.
- **Its step count.** Clients are ordered by their number of steps (most first), so the
  clients still training at step s are a prefix of the stack and each step slices it
  without a copy; a client that has finished is simply no longer in the slice.
- **Its optimizer.** SGD with the run's momentum and weight decay, each client's own
  learning rate per step (its `lr` hook), and FedProx's proximal pull μ·(w − w_anchor)
  when the hooks declare one (`ClientHooks.proximal_pull`), in `torch.optim.SGD`'s order:
  pull, weight decay, momentum, step. With `optimizer=momentum|adam|adamw` each client's
  moments and step count, from its own earlier rounds, are stacked too and updated as
  `torch.optim.SGD` / `Adam` / `AdamW` would (`clients.optimizers.StackedMoments`).
- **Its metrics.** steps, samples and the sample-weighted mean loss per client, so the
  virtual clock charges each client its own time.

Only hooks that declare `cohort_safe` run here (`fl.strategy.client.ClientHooks`), and
only models without buffers (no BatchNorm running statistics) or dropout: a module whose
forward depends on more than its parameters and input would not batch faithfully.

Numbers: batched kernels sum in another order than one client's kernels, so the result is
not bit-identical; `STEP_TOLERANCE` is the documented bound per step on the weights,
`DRIFT_TOLERANCE` in norm over a round, and `METRIC_TOLERANCE` on a short run's metrics
(tests/test_cohort.py and experiments/gpu_check.py check them against the per-client
path). A ReLU or max-pool input at a tie is the exception to the first two (see there).

Why one module: the batch plan, the three gradient paths (vmap, the CPU conv trunk,
the grouped MLP) and the stacked update share one layout of the stacked weights and
one padding/masking rule; split apart, each would have to re-derive both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vmap

from clients.optimizers import OptimizerState, StackedMoments
from clients.trainer import LocalResult, TrainSettings, _batches
from fl.strategy.client import ClientHooks
from fl.wire.records import Layout
from fl.world.models import conv_input

__all__ = [
    "DRIFT_TOLERANCE",
    "METRIC_TOLERANCE",
    "STEP_TOLERANCE",
    "Member",
    "cohort_unfit",
    "train_cohort",
]

# Per local step, |w_cohort − w_alone| ≤ atol + rtol·|w_alone| on every weight (float32):
# the two paths differ only in the summation order of batched kernels.
STEP_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# The same per client over a whole round, in norm: ‖w_cohort − w_alone‖₂ ≤ this ·
# ‖w_alone − w_start‖₂; what experiments/gpu_check.py holds the MLP cohort on CUDA to.
# Neither bound holds where an input of a ReLU or max-pool sits at a tie: another summation
# order may flip it, and that client's round then differs by a discrete step (1 of 200
# LeNet-5 clients on shapes: one weight off by 1e-5 after a step, 3.8e-3 of its round's
# update in norm; the other 199 within 2e-8). Bit-identity is not expected either way.
DRIFT_TOLERANCE = 1e-4
# A short run's metrics (accuracy, loss, diagnostics) with engine.cohort=auto against the
# per-client run's: relative and absolute. Counts (steps, samples, bytes, virtual time) are
# equal: every client takes its own batches.
METRIC_TOLERANCE = {"rel": 1e-4, "abs": 1e-6}

_STATEFUL = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._NormBase)


@dataclass
class Member:
    """One client of a cohort: its starting weights (a flat float32 vector in `Layout`
    order, after its hooks' `load` and `begin`), its data, its hooks, its settings and its
    optimizer's memory (updated in place; None: fresh)."""

    start: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    hooks: ClientHooks
    settings: TrainSettings
    memory: OptimizerState | None = None


def cohort_unfit(model: nn.Module) -> str | None:
    """Why `model` cannot be trained as a cohort (buffers, dropout), or None."""
    if any(True for _ in model.buffers()):
        return "the model has buffers (BatchNorm statistics)"
    if any(isinstance(m, _STATEFUL) for m in model.modules()):
        return "the model has dropout or normalisation layers"
    return None


def _stack_params(
    layout: Layout, flat: torch.Tensor, device: torch.device
) -> dict[str, torch.Tensor]:
    """(K, D) flat weights -> {name: (K, *shape)} on `device`, in one transfer."""
    flat = flat.to(device)
    k, out, offset = flat.shape[0], {}, 0
    for name, shape, size in zip(layout.names, layout.shapes, layout.sizes, strict=True):
        out[name] = flat[:, offset : offset + size].reshape(k, *shape).contiguous()
        offset += size
    return out


class _Plan:
    """Every client's batches, ordered by step count: what each step trains on.

    Each client's batches are `clients.trainer._batches` (its seeded permutations, cut in
    order). Where its hooks keep the run's batch size, they are cut with a few kernels for
    the whole cohort rather than batch by batch (`_entries`), and each step's rows are
    laid out for its active clients only, padded to its widest batch as `pad_sequence`
    would: the same indices, the same padding. (A padded table of every client × the
    longest client's steps was ~17× the batches with the synthetic task's lognormal sizes.)
    """

    def __init__(self, members: Sequence[Member], device: torch.device) -> None:
        sizes, (client, step, slot, index) = _entries(members)
        steps = (sizes > 0).sum(1)
        # most steps first (stable): the clients still training at step s are a prefix
        order = torch.sort(steps, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        self.order: list[int] = order.tolist()
        self.steps = steps[order]
        self.samples = sizes.sum(1)[order].tolist()
        at = torch.arange(int(self.steps.max()))
        self.active: list[int] = (self.steps[:, None] > at).sum(0).tolist()
        sizes = sizes[order]
        # each step pads to its widest active batch, as `pad_sequence` would
        widths = [int(sizes[:active, s].max()) for s, active in enumerate(self.active)]
        spans = [a * w for a, w in zip(self.active, widths, strict=True)]
        starts = torch.tensor([0, *spans]).cumsum(0)
        lengths = torch.tensor([m.y.shape[0] for m in members])
        offsets = lengths.cumsum(0) - lengths  # each client's first row in the cohort's data
        # a padded slot holds its client's first row (masked out), a batch's slot its sample
        rows = torch.cat(
            [
                offsets[order[:a], None].expand(a, w).reshape(-1)
                for a, w in zip(self.active, widths, strict=True)
            ]
        )
        width = torch.tensor(widths)
        rows[starts[step] + rank[client] * width[step] + slot] += index
        # made on the CPU and moved to `device` in one transfer each
        rows, sizes = rows.to(device), sizes.to(device)
        self.rows = [
            rows[b : b + span].view(a, w)
            for b, span, a, w in zip(starts[:-1].tolist(), spans, self.active, widths, strict=True)
        ]
        self.sizes = [sizes[:a, s] for s, a in enumerate(self.active)]

    def step(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step s's rows of the cohort's data (active, padded width), mask and sizes."""
        rows, sizes = self.rows[s], self.sizes[s]
        mask = torch.arange(rows.shape[1], device=rows.device) < sizes[:, None]
        return rows, mask, sizes


def _gather(data: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`data[rows]` through `index_select`: the same values, ~3× faster than advanced
    indexing on the CPU, which a step with few active clients pays mostly in overhead."""
    return data.index_select(0, rows.reshape(-1)).view(*rows.shape, *data.shape[1:])


def _entries(
    members: Sequence[Member],
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each member's batch sizes by step, (K, steps) (0 past its last step), and every
    batched sample as (member, step, slot in the batch, its index in the member's data).

    Per member only its generator and its permutations are made (one per epoch, as
    `_batches` draws them); cutting them into batches is a few kernels for the cohort."""
    custom = [type(m.hooks).batch_size is not ClientHooks.batch_size for m in members]
    asked = [(m.y.shape[0], m.settings.batch_size, m.settings.local_steps) for m in members]
    n, size, steps = torch.tensor(asked).T
    per_epoch = (n + size - 1) // size
    epochs_asked = torch.tensor([m.settings.local_epochs for m in members])
    steps = torch.where(steps > 0, steps, per_epoch * epochs_asked)
    epochs = (steps + per_epoch - 1) // per_epoch
    perms, ragged = [], {}
    generator = torch.Generator()  # reseeded per member: as a fresh one seeded alike
    for k, (m, count) in enumerate(zip(members, epochs.tolist(), strict=True)):
        generator.manual_seed(m.settings.seed)
        if custom[k]:  # its own batch sizes: batch by batch
            ragged[k] = list(_batches(m.y.shape[0], generator, m.settings, m.hooks))
            steps[k], epochs[k] = len(ragged[k]), 0
            continue
        perms += [torch.randperm(m.y.shape[0], generator=generator) for _ in range(count)]
    # the cohort's permutations end to end: whose, which epoch, which place in it
    owner = torch.repeat_interleave(torch.arange(len(members)), epochs)
    firsts = torch.repeat_interleave(epochs.cumsum(0) - epochs, epochs)
    epoch = torch.arange(len(owner)) - firsts
    chunk = torch.repeat_interleave(torch.arange(len(owner)), n[owner])
    client = owner[chunk]
    place = torch.arange(len(chunk)) - (n[owner].cumsum(0) - n[owner])[chunk]
    step = epoch[chunk] * per_epoch[client] + place // size[client]
    kept = step < steps[client]
    flat = torch.cat(perms) if perms else torch.zeros(0, dtype=torch.long)
    entries = [(client[kept], step[kept], (place % size[client])[kept], flat[kept])]
    at = torch.arange(int(steps.max()))[None, :]
    last = (n - (per_epoch - 1) * size)[:, None]  # each epoch's last batch
    sizes = torch.where(at % per_epoch[:, None] == per_epoch[:, None] - 1, last, size[:, None])
    sizes = torch.where(at < steps[:, None], sizes, 0)
    for k, batches in ragged.items():
        lengths = torch.tensor([len(b) for b in batches])
        sizes[k] = 0
        sizes[k, : len(batches)] = lengths
        batch_of = torch.repeat_interleave(torch.arange(len(batches)), lengths)
        slots = torch.arange(len(batch_of)) - (lengths.cumsum(0) - lengths)[batch_of]
        entries.append((torch.full_like(batch_of, k), batch_of, slots, torch.cat(batches)))
    client, step, slot, index = (torch.cat(column) for column in zip(*entries, strict=True))
    return sizes, (client, step, slot, index)


# (stacked weights of the active clients, their rows (n, B, *input), labels (n, B), mask
# (n, B), batch sizes (n,)) -> (each weight's gradient, each client's batch loss)
Gradients = Callable[
    [dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[dict[str, torch.Tensor], torch.Tensor],
]


# Layers without weights that act on each sample alone: a conv trunk's, run per client.
_PER_SAMPLE = (nn.ReLU, nn.MaxPool2d, nn.AdaptiveMaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)
# Below this many input pixels a client batch (batch size × H × W of the first conv), `vmap`
# is cheaper than the per-client trunk on the CPU: its dispatch is shared, and the small
# grouped convs are fast. Measured (experiments/bench_conv_trunk.py): the cnn on 8×8
# digits at batch 16 (1024) favours vmap 1.5–1.8×; LeNet-5 at 16×16, batch 16 (4096) favours the
# trunk 1.2× and at 32×32, batch 16 or 32, 1.6–1.9×.
TRUNK_MIN_PIXELS = 4096


def _gradients(model: nn.Module, trunk_pays: bool = False) -> Gradients:
    """Every active client's loss gradient in one program.

    A Sequential of Flatten, Linear and ReLU layers (logreg, the MLP) is a chain of grouped
    matmuls whose backward is written out here (a few kernels per layer, no autograd
    graph). A Sequential of Conv2d and per-sample layers up to a Flatten, then Linear and
    ReLU layers (the cnn, LeNet-5) runs, where `trunk_pays`, its conv trunk client by client
    (one client's batch stays in cache, and the CPU's plain conv kernels are faster
    than the grouped ones `vmap` makes of a stacked conv) and its head as grouped
    matmuls, with one autograd backward. Any other model runs `torch.func.vmap` over
    `functional_call` and one autograd backward of the clients' summed losses
    (independent clients: each gets its own gradient), which costs more dispatch per step.
    """
    layers = list(model.children()) if isinstance(model, nn.Sequential) else []
    names = [name for name, _ in model.named_children()]
    grouped = bool(layers) and all(
        type(layer) in (nn.Linear, nn.ReLU) or _flattens(layer) for layer in layers
    )
    if grouped:
        return functools.partial(_grouped_mlp, names, layers)
    cut = next((i for i, layer in enumerate(layers) if type(layer) is nn.Linear), 0)
    trunk = (
        trunk_pays
        and cut > 1
        and _flattens(layers[cut - 1])
        and any(type(layer) is nn.Conv2d for layer in layers[:cut])
        and all(type(layer) in (nn.Conv2d, *_PER_SAMPLE) for layer in layers[: cut - 1])
        and all(type(layer) in (nn.Linear, nn.ReLU) for layer in layers[cut:])
    )
    if trunk:
        return functools.partial(_trunk_autograd, names, layers, cut)
    return functools.partial(_vmap_autograd, vmap(functools.partial(functional_call, model)))


def _flattens(layer: nn.Module) -> bool:
    """Whether `layer` flattens each sample (all but the batch axis)."""
    return type(layer) is nn.Flatten and (layer.start_dim, layer.end_dim) == (1, -1)


def _trunk_pays(x: torch.Tensor, batch_size: int) -> bool:
    """Whether a conv model's per-client trunk beats `vmap` here: on the CPU, for client
    batches of at least `TRUNK_MIN_PIXELS` input pixels (a choice fixed by the config, not
    timed, so that the run's numbers do not depend on the clock)."""
    return (
        x.device.type == "cpu"
        and x.dim() == 4
        and batch_size * x.shape[2] * x.shape[3] >= TRUNK_MIN_PIXELS
    )


def _batch_losses(
    log_probs: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, sizes: torch.Tensor
) -> torch.Tensor:
    """Each client's mean cross-entropy over its own batch (padded rows weigh 0)."""
    picked = log_probs.gather(2, y.unsqueeze(2)).squeeze(2)
    return -(picked * mask).sum(1) / sizes


def _backward(
    params: dict[str, torch.Tensor],
    logits: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    sizes: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each client's gradients (one backward of the summed per-client losses) and losses."""
    losses = _batch_losses(torch.log_softmax(logits, dim=2), y, mask, sizes)
    losses.sum().backward()
    return {n: p.grad for n, p in params.items() if p.grad is not None}, losses.detach()


def _vmap_autograd(
    forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    sizes: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    params = {n: w.detach().requires_grad_() for n, w in weights.items()}
    return _backward(params, forward(params, x), y, mask, sizes)


def _trunk_autograd(
    names: list[str],
    layers: list[nn.Module],
    cut: int,
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    sizes: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Layers before `cut` client by client (the per-client trainer's very kernels), the
    Linear/ReLU head from `cut` as grouped matmuls; one backward of the summed losses."""
    params = {n: w.detach().requires_grad_() for n, w in weights.items()}
    mine = {n: p.unbind(0) for n, p in params.items()}  # unbind: one stack in the backward
    features = []
    for k, h in enumerate(x.unbind(0)):
        h = conv_input(h)
        for name, layer in zip(names[:cut], layers[:cut], strict=True):
            if isinstance(layer, nn.Conv2d):
                bias = mine.get(f"{name}.bias")
                h = layer._conv_forward(
                    h, mine[f"{name}.weight"][k], None if bias is None else bias[k]
                )
            else:
                h = layer(h)
        features.append(h)
    h = torch.stack(features)
    for name, layer in zip(names[cut:], layers[cut:], strict=True):
        if isinstance(layer, nn.Linear):
            weight, bias = params[f"{name}.weight"].transpose(1, 2), params.get(f"{name}.bias")
            h = (
                torch.bmm(h, weight)
                if bias is None
                else torch.baddbmm(bias.unsqueeze(1), h, weight)
            )
        else:
            h = torch.relu(h)
    return _backward(params, h, y, mask, sizes)


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last axis, computed class-major: under ATen's AVX-512
    dispatch (the default on this machine) its kernel along a short last axis (a few
    classes) is ~9× slower than along the leading axis of the same values, which give the
    same bits there; under AVX2 both are fast and agree up to rounding (~5e-7;
    `tests/test_cohort.py` checks the agreement, experiments/RESULTS.md "Issue 37" times it)."""
    classes = logits.shape[-1]
    flat = logits.reshape(-1, classes).t().contiguous()
    return torch.log_softmax(flat, dim=0).t().reshape(logits.shape)


def _grouped_mlp(
    names: list[str],
    layers: list[nn.Module],
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    sizes: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    inputs: list[tuple[str, torch.Tensor]] = []  # (layer name, its input) per Linear
    gates: dict[str, torch.Tensor] = {}  # the output of the ReLU after a Linear
    last = ""
    for name, layer in zip(names, layers, strict=True):
        if isinstance(layer, nn.Flatten):
            x = x.flatten(2)
        elif isinstance(layer, nn.Linear):
            inputs.append((name, x))
            bias = weights.get(f"{name}.bias")
            weight = weights[f"{name}.weight"].transpose(1, 2)
            x = (
                torch.bmm(x, weight)
                if bias is None
                else torch.baddbmm(bias.unsqueeze(1), x, weight)
            )
            last = name
        else:
            x = gates[last] = torch.relu(x)
    log_probs = _log_softmax(x)
    losses = _batch_losses(log_probs, y, mask, sizes)
    # d(mean CE)/d logits = (softmax − one-hot) / batch size, 0 on padded rows
    delta = log_probs.exp().contiguous()  # batch-major, as the matmuls below expect
    delta.scatter_add_(2, y.unsqueeze(2), torch.full_like(delta[..., :1], -1.0))
    delta *= (mask / sizes[:, None]).unsqueeze(2)
    grads: dict[str, torch.Tensor] = {}
    for depth in range(len(inputs) - 1, -1, -1):
        name, given = inputs[depth]
        if name in gates:  # ReLU's own backward kernel, as autograd runs it
            delta = torch.ops.aten.threshold_backward(delta, gates[name], 0)
        grads[f"{name}.weight"] = torch.bmm(delta.transpose(1, 2), given)
        if f"{name}.bias" in weights:
            grads[f"{name}.bias"] = delta.sum(1)
        if depth:
            delta = torch.bmm(delta, weights[f"{name}.weight"])
    return grads, losses


class _Rates:
    """Each step's learning rate per client (plan order): the run's, or its `lr` hook's."""

    def __init__(self, members: Sequence[Member], order: list[int], device: torch.device):
        self.base = torch.tensor([members[i].settings.lr for i in order], device=device)
        self.hooked = [
            (rank, members[i].hooks, members[i].settings.lr)
            for rank, i in enumerate(order)
            if type(members[i].hooks).lr is not ClientHooks.lr
        ]

    def at(self, step: int, active: int) -> torch.Tensor:
        if not self.hooked:
            return self.base[:active]
        rates = self.base[:active].clone()
        for rank, hooks, base in self.hooked:
            if rank < active:  # called once per step the client takes, as alone
                rates[rank] = hooks.lr(step, base)
        return rates


def train_cohort(
    model: nn.Module, layout: Layout, members: Sequence[Member], device: torch.device
) -> tuple[torch.Tensor, list[LocalResult]]:
    """Train every member from its `start` as `train_locally` would, all at once.

    `model` gives the architecture (its own weights are not used or changed). Returns the
    trained weights, one flat float32 CPU row per member in the order given, and each
    member's `LocalResult`. Members must share the optimizer and its settings (one run's).
    """
    if not members:
        return torch.empty(0, layout.numel), []
    reason = cohort_unfit(model)
    if reason is not None:
        raise ValueError(f"cannot train a cohort: {reason}")
    for m in members:
        if len(m.y) == 0:
            raise ValueError("this client has no training data")
        if not type(m.hooks).cohort_safe:
            raise ValueError(f"{type(m.hooks).__name__} does not declare cohort_safe")
    first = members[0].settings
    momentum, decay, kind, betas, eps = _optimizer_of(first)
    if any(_optimizer_of(m.settings) != _optimizer_of(first) for m in members):
        raise ValueError("a cohort shares one optimizer, momentum, weight decay, betas and eps")
    plan = _Plan(members, device)
    order = plan.order
    x = torch.cat([m.x for m in members]).to(device)
    y = torch.cat([m.y for m in members]).to(device)
    weights = _stack_params(layout, torch.stack([members[i].start for i in order]), device)
    pulls = [members[i].hooks.proximal_pull() for i in order]
    mu = torch.tensor([p[0] if p else 0.0 for p in pulls], device=device)
    anchors = None
    if any(p is not None for p in pulls):
        rows = [
            torch.cat([a.detach().reshape(-1).float().cpu() for a in p[1]])
            if p
            else members[i].start
            for p, i in zip(pulls, order, strict=True)
        ]
        anchors = _stack_params(layout, torch.stack(rows), device)
    buffers = {n: torch.zeros_like(w) for n, w in weights.items()} if momentum else {}
    rates = _Rates(members, order, device)
    kept = None  # the moments of a stateful optimizer, kept across rounds
    if kind != "sgd":
        kept = StackedMoments(
            kind,
            [members[i].memory or OptimizerState.zeros(kind, layout.numel) for i in order],
            lambda rows: _stack_params(layout, rows, device),
            (momentum, decay, betas, eps),
            device,
        )

    gradients = _gradients(model, _trunk_pays(x, first.batch_size))
    loss_sum = torch.zeros(len(members), device=device)
    model.train()
    for s, active in enumerate(plan.active):
        rows, mask, sizes = plan.step(s)
        params = {n: w[:active] for n, w in weights.items()}
        batch_x, batch_y = _gather(x, rows), _gather(y, rows)
        grads, losses = gradients(params, batch_x, batch_y, mask.to(x.dtype), sizes)
        lr = rates.at(s, active)
        if kept is not None:
            kept.begin_step(s, active, lr)
        with torch.no_grad():
            for name, stacked in weights.items():
                w, g = stacked[:active], grads[name]  # a weight the loss does not reach: KeyError
                view = (active,) + (1,) * (w.dim() - 1)
                if anchors is not None:
                    g = g + mu[:active].view(view) * (w - anchors[name][:active])
                if kept is not None:
                    kept.apply(name, w, g, lr.view(view))
                    continue
                if decay:
                    g = g + decay * w
                if momentum:
                    buf = buffers[name][:active]
                    if s == 0:
                        buf.copy_(g)
                    else:
                        buf.mul_(momentum).add_(g)
                    g = buf
                w.addcmul_(lr.view(view), g, value=-1)
            loss_sum[:active] += losses * sizes
    trained = torch.cat([w.reshape(len(members), -1) for w in weights.values()], dim=1).cpu()
    samples = plan.samples
    means = (loss_sum.cpu() / torch.tensor(samples).clamp(min=1)).tolist()
    out_rows = torch.empty_like(trained)
    out_rows[torch.tensor(order)] = trained
    results: list[LocalResult | None] = [None] * len(members)
    taken = plan.steps.tolist()
    for rank, i in enumerate(order):
        results[i] = LocalResult(taken[rank], samples[rank], means[rank])
        members[i].hooks.time.samples = samples[rank]
    if kept is not None:
        _keep_moments(members, order, kept, plan.steps)
    return out_rows, [r for r in results if r is not None]


def _optimizer_of(settings: TrainSettings) -> tuple[float, float, str, tuple[float, float], float]:
    """What a cohort's members must share: momentum, weight decay, optimizer, betas, eps."""
    return (
        settings.momentum,
        settings.weight_decay,
        settings.optimizer,
        settings.betas,
        settings.eps,
    )


def _keep_moments(
    members: Sequence[Member], order: list[int], kept: StackedMoments, steps: torch.Tensor
) -> None:
    """Each member's optimizer memory after the round (a fresh one where it had none)."""
    rows = {name: kept.rows(name) for name in kept.moments}
    for rank, i in enumerate(order):
        taken = int(steps[rank])
        memory = members[i].memory
        if memory is None:
            memory = members[i].memory = OptimizerState(0, {})
        if taken:
            memory.moments = {name: rows[name][rank].clone() for name in rows}
            memory.step += taken
        elif not memory.moments:
            memory.moments = {name: torch.zeros(rows[name].shape[1]) for name in rows}
