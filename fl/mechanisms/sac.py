"""SAC-Discrete: a soft actor-critic over a finite action set, seeded and checkpointable.

Christodoulou, "Soft Actor-Critic for Discrete Action Settings", 2019 (equations as in
shared/specs/algorithms_b.md §1.3). An actor gives a softmax over the actions; two
critics give a value per action, each with a Polyak-averaged target copy; the entropy
temperature α is learned towards a target entropy of `target_entropy_ratio · log |A|`.
Because the action set is finite, every expectation over the policy is an exact sum,
so no reparameterisation is needed.

Server-side controllers (ASFL's choice of quota and lag tolerance) use it, so it must
be as reproducible as the rest of a run: every random draw (initial weights, actions,
replay batches) comes from one `torch.Generator` seeded by the caller, nothing reads
torch's global generator, and `state_dict()` holds the networks, optimisers, replay
buffer and generator as tensors and plain containers (loadable with `weights_only`).
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ReplayBuffer", "SACConfig", "SACDiscrete"]


@dataclass(frozen=True)
class SACConfig:
    """Sizes and hyper-parameters; defaults are the spec's proposals (§1.3)."""

    state_dim: int
    num_actions: int
    hidden: int = 64  # two hidden layers of this width in every network
    lr: float = 3e-4  # Adam, for actor, critics and temperature
    gamma: float = 0.99
    polyak: float = 0.005  # target ← (1 - polyak)·target + polyak·critic
    batch_size: int = 64
    buffer_size: int = 100_000
    target_entropy_ratio: float = 0.98  # target entropy = ratio · log |A|


class ReplayBuffer:
    """A ring buffer of transitions (s, a, r, s') held as preallocated tensors."""

    def __init__(self, capacity: int, state_dim: int) -> None:
        self.states = torch.zeros(capacity, state_dim)
        self.actions = torch.zeros(capacity, dtype=torch.int64)
        self.rewards = torch.zeros(capacity)
        self.next_states = torch.zeros(capacity, state_dim)
        self.size = 0
        self.position = 0

    def add(
        self, state: torch.Tensor, action: int, reward: float, next_state: torch.Tensor
    ) -> None:
        """Store one transition, overwriting the oldest once full."""
        i = self.position
        self.states[i], self.actions[i] = state, action
        self.rewards[i], self.next_states[i] = reward, next_state
        self.position = (i + 1) % len(self.actions)
        self.size = min(self.size + 1, len(self.actions))

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A uniform batch (with replacement) of the stored transitions."""
        index = torch.randint(self.size, (batch_size,), generator=generator)
        return {
            "states": self.states[index],
            "actions": self.actions[index],
            "rewards": self.rewards[index],
            "next_states": self.next_states[index],
        }

    def state_dict(self) -> dict[str, Any]:
        """The stored transitions only (the unused tail is not saved)."""
        n = self.size
        return {
            "states": self.states[:n].clone(),
            "actions": self.actions[:n].clone(),
            "rewards": self.rewards[:n].clone(),
            "next_states": self.next_states[:n].clone(),
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        n = len(state["actions"])
        self.states[:n], self.actions[:n] = state["states"], state["actions"]
        self.rewards[:n], self.next_states[:n] = state["rewards"], state["next_states"]
        self.size, self.position = n, int(state["position"])


def _network(config: SACConfig, generator: torch.Generator) -> nn.Sequential:
    """state → hidden → hidden → one output per action; weights drawn from `generator`
    (torch's default uniform(±1/sqrt(fan_in)) init, without touching the global RNG)."""
    sizes = (config.state_dim, config.hidden, config.hidden, config.num_actions)
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        linear = nn.utils.skip_init(nn.Linear, fan_in, fan_out)
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class SACDiscrete:
    """Actor, twin critics with targets, learned temperature, replay buffer, generator."""

    def __init__(self, config: SACConfig, seed: int) -> None:
        self.config = config
        self.generator = torch.Generator().manual_seed(seed)
        self.actor = _network(config, self.generator)
        self.critics = nn.ModuleList([_network(config, self.generator) for _ in range(2)])
        self.targets = nn.ModuleList([_network(config, self.generator) for _ in range(2)])
        self.targets.load_state_dict(self.critics.state_dict())
        self.targets.requires_grad_(False)
        self.log_alpha = torch.zeros(1, requires_grad=True)
        self.target_entropy = config.target_entropy_ratio * math.log(config.num_actions)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=config.lr)
        self.critic_optimizer = torch.optim.Adam(self.critics.parameters(), lr=config.lr)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=config.lr)
        self.buffer = ReplayBuffer(config.buffer_size, config.state_dim)

    @property
    def alpha(self) -> float:
        """The current entropy temperature."""
        return float(self.log_alpha.detach().exp())

    def policy(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities and log-probabilities of every action, per state."""
        logits = self.actor(states)
        return F.softmax(logits, dim=-1), F.log_softmax(logits, dim=-1)

    def act(self, state: torch.Tensor) -> int:
        """An action drawn from the policy at `state` (exploration comes from entropy)."""
        with torch.no_grad():
            probs, _ = self.policy(state.unsqueeze(0))
        return int(torch.multinomial(probs[0], 1, generator=self.generator))

    def remember(
        self, state: torch.Tensor, action: int, reward: float, next_state: torch.Tensor
    ) -> None:
        """Add one transition to the replay buffer."""
        self.buffer.add(state, action, reward, next_state)

    def update(self) -> dict[str, float] | None:
        """One gradient step on a replay batch; None until the buffer holds a batch."""
        if self.buffer.size < self.config.batch_size:
            return None
        return self.learn(self.buffer.sample(self.config.batch_size, self.generator))

    def critic_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Σ_j mean (Q_j(s, a) − y)² with the soft target
        y = r + γ Σ_a' π(a'|s') [min_j Q̄_j(s', a') − α log π(a'|s')]."""
        with torch.no_grad():
            probs, log_probs = self.policy(batch["next_states"])
            next_q = torch.min(*(t(batch["next_states"]) for t in self.targets))
            soft_value = (probs * (next_q - self.alpha * log_probs)).sum(-1)
            target = batch["rewards"] + self.config.gamma * soft_value
        actions = batch["actions"].unsqueeze(-1)
        losses = [
            F.mse_loss(c(batch["states"]).gather(-1, actions).squeeze(-1), target)
            for c in self.critics
        ]
        return losses[0] + losses[1]

    def learn(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Critic, actor and temperature steps on `batch`, then the Polyak target update."""
        critic_loss = self.critic_loss(batch)
        self.critic_optimizer.zero_grad()
        critic_loss.backward()
        self.critic_optimizer.step()

        probs, log_probs = self.policy(batch["states"])
        with torch.no_grad():
            q = torch.min(*(c(batch["states"]) for c in self.critics))
        actor_loss = (probs * (self.alpha * log_probs - q)).sum(-1).mean()
        self.actor_optimizer.zero_grad()
        actor_loss.backward()
        self.actor_optimizer.step()

        entropy = -(probs.detach() * log_probs.detach()).sum(-1)
        alpha_loss = (self.log_alpha * (entropy - self.target_entropy)).mean()
        self.alpha_optimizer.zero_grad()
        alpha_loss.backward()
        self.alpha_optimizer.step()

        with torch.no_grad():
            for target, critic in zip(
                self.targets.parameters(), self.critics.parameters(), strict=True
            ):
                target.lerp_(critic, self.config.polyak)
        return {
            "critic_loss": float(critic_loss.detach()),
            "actor_loss": float(actor_loss.detach()),
            "alpha": self.alpha,
            "entropy": float(entropy.mean()),
        }

    def state_dict(self) -> dict[str, Any]:
        """Networks, optimisers, temperature, replay buffer and generator state (copies:
        an optimiser's own state_dict shares its moment tensors with the live optimiser)."""
        return copy.deepcopy(
            {
                "actor": self.actor.state_dict(),
                "critics": self.critics.state_dict(),
                "targets": self.targets.state_dict(),
                "log_alpha": self.log_alpha.detach().clone(),
                "actor_optimizer": self.actor_optimizer.state_dict(),
                "critic_optimizer": self.critic_optimizer.state_dict(),
                "alpha_optimizer": self.alpha_optimizer.state_dict(),
                "buffer": self.buffer.state_dict(),
                "generator": self.generator.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.actor.load_state_dict(state["actor"])
        self.critics.load_state_dict(state["critics"])
        self.targets.load_state_dict(state["targets"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.buffer.load_state_dict(state["buffer"])
        self.generator.set_state(state["generator"])
