"""The client's local optimizer (`optimizer=sgd|momentum|adam|adamw`) and its memory between rounds.

`sgd` is today's trainer: `torch.optim.SGD` with the run's momentum and weight decay,
built afresh every round (a momentum buffer lives for one round). `momentum` (heavy-ball
SGD), `adam` and `adamw` (decoupled weight decay) keep each client's optimizer state
across its rounds, as a client process that keeps its optimizer would (APF's journal
LeNet-5 headline trains with Adam at lr 1e-3): the state is an `OptimizerState` kept in
the node's `Context.state` under `STATE_KEY`, so it is checkpointed and resumed with the
rest of the node's memory. It is read back as untrusted data: exactly the moments the
optimizer keeps, one float32 value per model parameter scalar, finite, a step count ≥ 0
and second moments ≥ 0, else one ValueError line naming what is wrong.

Under APF the moments of a frozen scalar keep integrating its gradient while the roll-back
after every step holds its value (our choice: the spec says nothing; the paper's code rolls
values back after `optimizer.step()` the same way), so it resumes from them when it thaws.

`StackedMoments` is the same update for a cohort (`clients.cohort`): every client's
moments stacked on a leading client axis, each client with its own step count, in the
order and arithmetic of `torch.optim.SGD` / `torch.optim.Adam` (single-tensor path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fl.run.settings import OPTIMIZERS
from fl.wire.records import array_to_numpy, numpy_to_array

__all__ = [
    "MOMENTS",
    "OPTIMIZERS",
    "STATE_KEY",
    "OptimizerState",
    "StackedMoments",
    "make_optimizer",
]

# optimizer (one of conf/config.yaml's OPTIMIZERS) -> the per-scalar moments it keeps
# between steps (and, but for sgd, between rounds)
MOMENTS: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "momentum": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
}
STATE_KEY = "optimizer-state"


def make_optimizer(
    params: Sequence[nn.Parameter],
    optimizer: str,
    lr: float,
    momentum: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
) -> torch.optim.Optimizer:
    """The torch optimizer `optimizer` names, over `params`."""
    if optimizer in ("sgd", "momentum"):
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if optimizer in ("adam", "adamw"):
        kind = torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW
        return kind(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"optimizer={optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")


@dataclass
class OptimizerState:
    """One client's optimizer memory between rounds: its steps so far and its moments, each
    a flat float32 vector over the model's parameters (in `named_parameters` order)."""

    step: int
    moments: dict[str, torch.Tensor]

    @classmethod
    def fresh(cls, optimizer: str, numel: int) -> OptimizerState | None:
        """A client that has not trained yet (None for `sgd`, which keeps nothing)."""
        return cls.zeros(optimizer, numel) if MOMENTS[optimizer] else None

    @classmethod
    def zeros(cls, optimizer: str, numel: int) -> OptimizerState:
        """Step 0 and zero moments: what torch's optimizers start from."""
        return cls(0, {name: torch.zeros(numel) for name in MOMENTS[optimizer]})

    @classmethod
    def load(cls, state: RecordDict, optimizer: str, numel: int) -> OptimizerState | None:
        """The memory kept in `state`, checked as data; fresh where there is none."""
        if not MOMENTS[optimizer]:  # plain SGD keeps nothing: the state is not read
            return cls.fresh(optimizer, numel)
        record = state.array_records.get(STATE_KEY)
        if record is None:
            return cls.fresh(optimizer, numel)
        try:
            return cls._checked(record, optimizer, numel)
        except ValueError as err:
            raise ValueError(f"node state {STATE_KEY!r} refused: {err}") from None

    @classmethod
    def _checked(cls, record: ArrayRecord, optimizer: str, numel: int) -> OptimizerState:
        expected = {"step", *MOMENTS[optimizer]}
        if set(record.keys()) != expected:
            raise ValueError(
                f"holds {sorted(record.keys())}, optimizer={optimizer} keeps {sorted(expected)}"
            )
        step = array_to_numpy(record["step"])
        if step.shape != (1,) or step.dtype != np.int64 or int(step[0]) < 0:
            raise ValueError("step must be one int64 >= 0")
        moments = {}
        for name in MOMENTS[optimizer]:
            value = array_to_numpy(record[name])
            if value.shape != (numel,) or value.dtype != np.float32:
                raise ValueError(
                    f"{name} must be {numel} float32 values (the model's), "
                    f"not {value.dtype}{list(value.shape)}"
                )
            if not np.isfinite(value).all():
                raise ValueError(f"{name} has non-finite values")
            moments[name] = torch.from_numpy(value.copy())
        if "exp_avg_sq" in moments and bool((moments["exp_avg_sq"] < 0).any()):
            raise ValueError("exp_avg_sq has negative values (a second moment is >= 0)")
        return cls(int(step[0]), moments)

    def save(self, state: RecordDict) -> None:
        """Keep this memory in the node's persistent state."""
        arrays = {"step": numpy_to_array(np.array([self.step], dtype=np.int64))}
        for name, value in self.moments.items():
            arrays[name] = numpy_to_array(value.detach().float().cpu().numpy())
        state[STATE_KEY] = ArrayRecord(arrays)

    def restore(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
        """Put this memory into a torch optimizer over `params` (nothing before a first step:
        torch's own start is the same as zero moments at step 0)."""
        if self.step == 0:
            return
        for param, parts in zip(params, self._split(params), strict=True):
            entry: dict[str, torch.Tensor] = {
                name: value.view_as(param).to(param).clone() for name, value in parts.items()
            }
            if "exp_avg" in entry:  # torch's Adam counts steps in a float32 scalar tensor
                entry["step"] = torch.tensor(float(self.step), dtype=torch.float32)
            optimizer.state[param] = entry

    def keep(
        self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], steps: int
    ) -> None:
        """Read the memory back from the torch optimizer after `steps` more steps."""
        if steps == 0:
            return
        for name in self.moments:
            self.moments[name] = torch.cat(
                [
                    optimizer.state[p][name].detach().reshape(-1).float().cpu()
                    if name in optimizer.state.get(p, {})
                    else torch.zeros(p.numel())
                    for p in params
                ]
            )
        self.step += steps

    def _split(self, params: Sequence[nn.Parameter]) -> list[dict[str, torch.Tensor]]:
        sizes = [p.numel() for p in params]
        if sum(sizes) != next(iter(self.moments.values())).numel():
            raise ValueError(f"node state {STATE_KEY!r}: not the size of this model")
        pieces = {name: torch.split(value, sizes) for name, value in self.moments.items()}
        return [{name: pieces[name][i] for name in pieces} for i in range(len(sizes))]


# (K, D) flat rows -> {parameter name: (K, *shape)} on the cohort's device
Stacker = Callable[[torch.Tensor], dict[str, torch.Tensor]]


class StackedMoments:
    """A cohort's `momentum`/`adam`/`adamw` update: each client's moments and step count on a
    leading client axis (plan order), applied to the active clients' stacked weights."""

    def __init__(
        self,
        optimizer: str,
        memories: Sequence[OptimizerState],
        stack: Stacker,
        hyper: tuple[float, float, tuple[float, float], float],
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.momentum, self.decay, (self.beta1, self.beta2), self.eps = hyper
        self.start = torch.tensor([m.step for m in memories], dtype=torch.float64)
        self.moments = {
            name: stack(torch.stack([m.moments[name] for m in memories]))
            for name in MOMENTS[optimizer]
        }
        self.device = device
        self._factors: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin_step(self, s: int, active: int, lr: torch.Tensor) -> None:
        """Step s's per-client factors: Adam's lr / (1 − β1^t) and √(1 − β2^t)."""
        if self.optimizer == "momentum":
            return
        t = self.start[:active] + (s + 1)
        step_size = lr.double().cpu() / (1 - self.beta1**t)
        root = (1 - self.beta2**t).sqrt()
        self._factors = (step_size.to(self.device), root.to(self.device))

    def apply(self, name: str, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor) -> None:
        """One step on the active clients' weight `name` (w, in place) with gradient g;
        `lr` is each active client's rate, shaped to broadcast over w."""
        active = w.shape[0]
        view = (active,) + (1,) * (w.dim() - 1)
        if self.optimizer == "momentum":
            if self.decay:
                g = g + self.decay * w
            buf = self.moments["momentum_buffer"][name][:active]
            buf.mul_(self.momentum).add_(g)
            w.addcmul_(lr, buf, value=-1)
            return
        assert self._factors is not None
        step_size, root = (f.to(w.dtype).view(view) for f in self._factors)
        if self.decay and self.optimizer == "adamw":
            w.mul_(1 - lr * self.decay)
        elif self.decay:
            g = g + self.decay * w
        m, v = self.moments["exp_avg"][name][:active], self.moments["exp_avg_sq"][name][:active]
        m.lerp_(g, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        w.sub_(m / (v.sqrt() / root).add_(self.eps) * step_size)

    def rows(self, name: str) -> torch.Tensor:
        """Moment `name` of every client as (K, D) flat rows on the CPU."""
        stacked = self.moments[name]
        k = next(iter(stacked.values())).shape[0]
        return torch.cat([v.reshape(k, -1) for v in stacked.values()], dim=1).cpu()
