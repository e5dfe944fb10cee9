"""DP-SGD for local training through Opacus, with per-client accounting in `Context.state`.

The trainer keeps its in-memory tensors and loop; a `PrivateTraining` session swaps in
Opacus's `GradSampleModule` hooks (per-sample gradients) and `DPOptimizer` (per-sample
clipping to `max_grad_norm`, Gaussian noise σ·C), and draws Poisson-sampled batches,
which is what the accountant assumes. After the round, the (σ, q, steps) it used are
appended to the accountant history kept in the node's state, so ε accumulates over the
rounds the client takes part in, on every engine and across resume.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import torch
from flwr.app import ConfigRecord, RecordDict
from omegaconf import DictConfig
from torch import nn

__all__ = [
    "ACCOUNTANTS",
    "BUDGET_KEY",
    "DPSGD",
    "Plan",
    "PrivateTraining",
    "account",
    "epsilon_of",
    "history_of",
]

STATE_KEY = "dpsgd-accountant"  # ConfigRecord in Context.state: the accountant history
BUDGET_KEY = "dp-epsilon-budget"  # train-config key: ε granted by the ledger (sizes σ)
ACCOUNTANTS = ("rdp", "prv", "gdp")

History = list[tuple[float, float, int]]  # Opacus's (noise_multiplier, sample_rate, steps)


@dataclass(frozen=True)
class Plan:
    """How one client trains privately in one round."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    expected_batch_size: float


@dataclass(frozen=True)
class DPSGD:
    """The DP-SGD settings of a run (conf/privacy/dpsgd.yaml) and the training shape."""

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    target_epsilon: float | None
    accountant: str
    sampling: str
    rounds: int
    batch_size: int
    local_steps: int
    local_epochs: int

    @classmethod
    def from_config(cls, cfg: DictConfig) -> DPSGD | None:
        """The settings when `privacy=dpsgd`, else None."""
        p = cfg.privacy
        if p.name != "dpsgd":
            return None
        return cls(
            noise_multiplier=float(p.noise_multiplier),
            max_grad_norm=float(p.max_grad_norm),
            delta=float(p.delta),
            target_epsilon=None if p.target_epsilon is None else float(p.target_epsilon),
            accountant=str(p.accountant),
            sampling=str(p.sampling),
            rounds=int(cfg.rounds),
            batch_size=int(cfg.batch_size),
            local_steps=int(cfg.local_steps),
            local_epochs=int(cfg.local_epochs),
        )

    def plan(self, n: int, target_epsilon: float | None = None) -> Plan:
        """σ, sampling rate and steps of one round for a client with `n` examples.

        As Opacus's DPDataLoader: q = 1 / ceil(n / batch_size) and an epoch is 1/q steps.
        A target ε (the argument, else `target_epsilon`) sizes σ so that a client taking
        part in all `rounds` rounds ends at that ε; otherwise σ is `noise_multiplier`.
        """
        per_epoch = math.ceil(n / self.batch_size)
        rate = 1.0 / per_epoch
        steps = self.local_steps if self.local_steps > 0 else self.local_epochs * per_epoch
        target = self.target_epsilon if target_epsilon is None else target_epsilon
        sigma = (
            self.noise_multiplier
            if target is None
            else _noise_for(target, self.delta, rate, steps * self.rounds, self.accountant)
        )
        return Plan(sigma, rate, steps, n * rate)

    def session(self, n: int, config: ConfigRecord, seed: int) -> PrivateTraining:
        """This round's private training for a client with `n` examples.

        A ledger grant sent in the train config (BUDGET_KEY) sizes σ when present. Per-round
        step or batch keys (GIFT's `local-steps`) are not followed: the plan, the server's ε
        and the ledger's charges use the run's; such strategies declare `dpsgd_safe = False`
        on their server half and config validation refuses them with DP-SGD.
        """
        budget = cast(float | None, config.get(BUDGET_KEY))
        return PrivateTraining(self, self.plan(n, None if budget is None else float(budget)), seed)

    def projected_epsilon(self, plan: Plan, rounds: int) -> float:
        """ε of a client after `rounds` rounds of `plan`."""
        return epsilon_of([(plan.noise_multiplier, plan.sample_rate, plan.steps * rounds)], self)


@lru_cache(maxsize=1024)
def _noise_for(target: float, delta: float, rate: float, steps: int, accountant: str) -> float:
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(
            get_noise_multiplier(
                target_epsilon=target,
                target_delta=delta,
                sample_rate=rate,
                steps=steps,
                accountant=accountant,
            )
        )


def epsilon_of(history: Sequence[tuple[float, float, int]], dp: DPSGD) -> float:
    """ε at `dp.delta` of an accountant history, by Opacus's own accountant.

    For RDP this is `RDPAccountant.get_privacy_spent`'s arithmetic with the per-step RDP
    curve of each (σ, q) cached (Opacus recomputes it, ~0.15 s, on every call).
    """
    history = [h for h in history if h[2] > 0]
    if not history:  # no step taken: nothing released (RDP's conversion would say ε > 0)
        return 0.0
    with warnings.catch_warnings():  # "optimal order is the largest alpha": a looser bound
        warnings.simplefilter("ignore", UserWarning)
        if dp.accountant != "rdp":
            from opacus.accountants import create_accountant

            accountant = create_accountant(mechanism=dp.accountant)
            accountant.history = list(history)
            return float(accountant.get_epsilon(delta=dp.delta))
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis import rdp as analysis

        rdp = sum([_rdp_per_step(sigma, rate) * steps for sigma, rate, steps in history])
        eps, _ = analysis.get_privacy_spent(
            orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=dp.delta
        )
        return float(eps)


@lru_cache(maxsize=4096)
def _rdp_per_step(sigma: float, rate: float) -> Any:
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as analysis

    return analysis.compute_rdp(
        q=rate, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS
    )


def history_of(state: RecordDict) -> History:
    """The accountant history stored in a node's state."""
    if STATE_KEY not in state.config_records:
        return []
    record = state.config_records[STATE_KEY]
    noise = cast(list[float], record["noise"])
    rate = cast(list[float], record["sample-rate"])
    steps = cast(list[int], record["steps"])
    return [(float(a), float(b), int(c)) for a, b, c in zip(noise, rate, steps, strict=True)]


def account(state: RecordDict, plan: Plan, steps: int, dp: DPSGD) -> float:
    """Add `steps` steps of `plan` to the node's history; return its ε so far."""
    history = history_of(state)
    if steps > 0:
        if history and history[-1][:2] == (plan.noise_multiplier, plan.sample_rate):
            history[-1] = (plan.noise_multiplier, plan.sample_rate, history[-1][2] + steps)
        else:
            history.append((plan.noise_multiplier, plan.sample_rate, steps))
    state[STATE_KEY] = ConfigRecord(
        {
            "noise": [h[0] for h in history],
            "sample-rate": [h[1] for h in history],
            "steps": [h[2] for h in history],
        }
    )
    return epsilon_of(history, dp)


class PrivateTraining:
    """One client's DP-SGD for one round; `clients.trainer.train_locally` drives it."""

    def __init__(self, dp: DPSGD, plan: Plan, seed: int) -> None:
        self.dp = dp
        self.plan = plan
        self.seed = seed
        self._hooks: Any = None

    def attach(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, before_step: Callable[[], None]
    ) -> torch.optim.Optimizer:
        """Per-sample gradient hooks on `model`; the optimizer clips and noises.

        `before_step` (a strategy's gradient hook, e.g. FedProx's proximal term) runs on
        the privatised gradient, just before the parameter update.
        """
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        # torch's notice that the first layer's input needs no gradient: expected here
        warnings.filterwarnings("ignore", message="Full backward hook is firing")

        device = next(model.parameters()).device
        # strict: a layer Opacus cannot handle raises here (privacy.config names it before round 1)
        self._hooks = GradSampleModule(model, loss_reduction="mean", strict=True)
        private = DPOptimizer(
            optimizer,
            noise_multiplier=self.plan.noise_multiplier,
            max_grad_norm=self.dp.max_grad_norm,
            expected_batch_size=self.plan.expected_batch_size,
            loss_reduction="mean",
            generator=torch.Generator(device=device).manual_seed(self.seed ^ 0x5EED),
        )
        private.attach_step_hook(lambda _: before_step())
        return private

    def batches(self, n: int, generator: torch.Generator) -> Iterator[torch.Tensor] | None:
        """Poisson batches (each example independently with rate q), or None to shuffle."""
        if self.dp.sampling != "poisson":
            return None
        return (
            (torch.rand(n, generator=generator) < self.plan.sample_rate).nonzero().squeeze(1)
            for _ in range(self.plan.steps)
        )

    def account(self, state: RecordDict, steps: int) -> dict[str, float]:
        """Record the `steps` taken in the node's accountant; the reply's epsilon metric."""
        return {"epsilon": account(state, self.plan, steps, self.dp)}

    def detach(self) -> None:
        """Remove the hooks, leaving the model as it was (it is reused by later clients)."""
        if self._hooks is not None:
            self._hooks._close()
            self._hooks = None
