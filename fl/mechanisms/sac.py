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

Files: `save` writes the whole agent (to go on training it in a later run), `save_policy`
the actor alone (to act with, `GreedyPolicy`). A file read back, or an agent's state in a
checkpoint, is untrusted: loaded with `weights_only` from a regular file only, every
tensor checked for its kind, shape and finiteness against the agent it is loaded into,
and its values against bounds no training of ours leaves (below), the optimisers'
hyper-parameters kept from the caller's config (only their moments are read); any fault
is one `AgentFileError` line. Finite extremes are what break a run, not only NaN: weights
of 1e30 overflow the actor's logits, α = e^100 the losses, a negative Adam second moment
or step count the square roots of the next step. As a second guard, a learning step whose
loss or gradients are not finite is not taken.

Why one module: the file checks mirror the agent's own `state_dict` part by part (networks,
optimisers, buffer, generator); apart, each would reach into the other's internals.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fl.common.errors import RunError
from fl.common.files import open_regular, require_writable, write_atomic

__all__ = [
    "AgentFileError",
    "GreedyPolicy",
    "ReplayBuffer",
    "SACConfig",
    "SACDiscrete",
    "check_agent_file",
]

# Bounds on loaded values (ours; the paper has no files). Networks start within
# ±1/sqrt(fan_in) and Adam moves a weight by about lr a step, so no run of ours comes near
# PARAMETER_BOUND; within it and STATE_BOUND the logits stay far below float32's 3.4e38.
# α = exp(log α) spans LOG_ALPHA_RANGE: 2e-22 to 2.2e4, far wider than the temperature
# learned towards a target entropy of at most log |A| ever goes.
PARAMETER_BOUND = 1e4  # |w| of every network weight and bias
STATE_BOUND = 1e6  # |x| of every state the replay buffer holds
LOG_ALPHA_RANGE = (-50.0, 10.0)
AGENT_KIND = "sac-discrete-agent"  # the whole agent: networks, optimisers, buffer, generator
POLICY_KIND = "sac-discrete-policy"  # the actor alone


class AgentFileError(RunError, ValueError):
    """An agent or policy file that cannot be used, for the reason its one line states."""


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
    reward_bound: float = math.inf  # |r| of a stored reward (a loaded buffer is checked)


class ReplayBuffer:
    """A ring buffer of transitions (s, a, r, s', d) held as preallocated tensors; d = 1
    marks an episode's last transition (no value beyond it)."""

    def __init__(self, capacity: int, state_dim: int) -> None:
        self.states = torch.zeros(capacity, state_dim)
        self.actions = torch.zeros(capacity, dtype=torch.int64)
        self.rewards = torch.zeros(capacity)
        self.next_states = torch.zeros(capacity, state_dim)
        self.dones = torch.zeros(capacity)
        self.size = 0
        self.position = 0

    def add(
        self,
        state: torch.Tensor,
        action: int,
        reward: float,
        next_state: torch.Tensor,
        done: bool = False,
    ) -> None:
        """Store one transition, overwriting the oldest once full."""
        i = self.position
        self.states[i], self.actions[i] = state, action
        self.rewards[i], self.next_states[i] = reward, next_state
        self.dones[i] = float(done)
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
            "dones": self.dones[index],
        }

    def state_dict(self) -> dict[str, Any]:
        """The stored transitions only (the unused tail is not saved)."""
        n = self.size
        return {
            "states": self.states[:n].clone(),
            "actions": self.actions[:n].clone(),
            "rewards": self.rewards[:n].clone(),
            "next_states": self.next_states[:n].clone(),
            "dones": self.dones[:n].clone(),
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        n = len(state["actions"])
        self.states[:n], self.actions[:n] = state["states"], state["actions"]
        self.rewards[:n], self.next_states[:n] = state["rewards"], state["next_states"]
        self.dones[:n] = state.get("dones", 0.0)  # (checkpoints from before episodes: none)
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
        self,
        state: torch.Tensor,
        action: int,
        reward: float,
        next_state: torch.Tensor,
        done: bool = False,
    ) -> None:
        """Add one transition to the replay buffer (`done`: the episode's last)."""
        self.buffer.add(state, action, reward, next_state, done)

    def update(self) -> dict[str, float] | None:
        """One gradient step on a replay batch; None until the buffer holds a batch."""
        if self.buffer.size < self.config.batch_size:
            return None
        return self.learn(self.buffer.sample(self.config.batch_size, self.generator))

    def critic_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Σ_j mean (Q_j(s, a) − y)² with the soft target
        y = r + γ (1 − d) Σ_a' π(a'|s') [min_j Q̄_j(s', a') − α log π(a'|s')]."""
        with torch.no_grad():
            probs, log_probs = self.policy(batch["next_states"])
            next_q = torch.min(*(t(batch["next_states"]) for t in self.targets))
            soft_value = (probs * (next_q - self.alpha * log_probs)).sum(-1)
            ongoing = 1 - batch.get("dones", 0.0)  # (a batch built without them: no ends)
            target = batch["rewards"] + self.config.gamma * soft_value * ongoing
        actions = batch["actions"].unsqueeze(-1)
        losses = [
            F.mse_loss(c(batch["states"]).gather(-1, actions).squeeze(-1), target)
            for c in self.critics
        ]
        return losses[0] + losses[1]

    def learn(self, batch: dict[str, torch.Tensor]) -> dict[str, float] | None:
        """Critic, actor and temperature steps on `batch`, then the Polyak target update;
        None, and the rest of the update skipped, where a loss or gradient is not finite."""
        critic_loss = self.critic_loss(batch)
        if not _step(self.critic_optimizer, critic_loss):
            return None

        probs, log_probs = self.policy(batch["states"])
        with torch.no_grad():
            q = torch.min(*(c(batch["states"]) for c in self.critics))
        actor_loss = (probs * (self.alpha * log_probs - q)).sum(-1).mean()
        if not _step(self.actor_optimizer, actor_loss):
            return None

        entropy = -(probs.detach() * log_probs.detach()).sum(-1)
        alpha_loss = (self.log_alpha * (entropy - self.target_entropy)).mean()
        if not _step(self.alpha_optimizer, alpha_loss):
            return None

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

    # ----- files ----------------------------------------------------------------------
    def save(self, path: str | Path, meta: Mapping[str, Any] | None = None) -> None:
        """Write the whole agent to `path` (atomically); `meta`: what the caller's actions
        mean, checked on load (ASFL: its action grid)."""
        _write(path, AGENT_KIND, self.config, meta, self.state_dict())

    def save_policy(self, path: str | Path, meta: Mapping[str, Any] | None = None) -> None:
        """Write the actor alone to `path` (atomically): the policy `GreedyPolicy` loads."""
        _write(path, POLICY_KIND, self.config, meta, copy.deepcopy(self.actor.state_dict()))

    def load(self, path: str | Path, meta: Mapping[str, Any] | None = None) -> None:
        """Continue from the agent `save` wrote to `path`: every part checked first, the
        optimisers' moments read but their hyper-parameters kept from this config."""
        state = _read(path, (AGENT_KIND,), self.config, meta)
        self.load_state_dict(self.checked(state, f"agent file {path}"))

    def checked(self, state: Any, source: str) -> dict[str, Any]:
        """An untrusted `state_dict` (a file's, a checkpoint's) made safe to load: kinds,
        shapes and values checked, the optimisers' hyper-parameters replaced by this
        agent's; AgentFileError naming `source` and the first part that does not fit."""
        own = self.state_dict()
        check = _Checker(source)
        if not isinstance(state, dict) or set(state) != set(own):
            raise check.error("not an agent's state")
        state = dict(state)
        for name in ("actor", "critics", "targets"):
            check.like(state[name], own[name], name, bound=PARAMETER_BOUND)
        check.like(state["log_alpha"], own["log_alpha"], "log_alpha")
        low, high = LOG_ALPHA_RANGE
        if not low <= float(state["log_alpha"]) <= high:
            raise check.error(f"log_alpha {float(state['log_alpha']):.4g} is outside {low}…{high}")
        optimizers = {
            "actor_optimizer": self.actor_optimizer,
            "critic_optimizer": self.critic_optimizer,
            "alpha_optimizer": self.alpha_optimizer,
        }
        for name, optimizer in optimizers.items():
            moments = check.adam(state[name], optimizer, name)
            state[name] = {"state": moments, "param_groups": own[name]["param_groups"]}
        check.buffer(state["buffer"], self.config)
        check.like(state["generator"], own["generator"], "generator")
        try:  # on a scratch agent: a generator state torch refuses is one line too
            SACDiscrete(self.config, 0).load_state_dict(state)
        except (RuntimeError, ValueError, KeyError) as err:
            raise check.error(_first_line(err)) from None
        return state


class GreedyPolicy:
    """A trained actor that acts greedily: the most probable action at each state, with
    no sampling and no learning (evaluating a policy, not exploring with it)."""

    def __init__(self, config: SACConfig) -> None:
        self.actor = _network(config, torch.Generator())  # weights replaced by `load`

    @classmethod
    def load(
        cls, path: str | Path, config: SACConfig, meta: Mapping[str, Any] | None = None
    ) -> GreedyPolicy:
        """The actor of a policy file (`save_policy`) or of an agent file (`save`)."""
        body = _read(path, (POLICY_KIND, AGENT_KIND), config, meta)
        whole = isinstance(body, Mapping) and {"actor", "buffer"} <= body.keys()
        actor = body["actor"] if whole else body  # an agent file's actor, or a policy file
        policy = cls(config)
        check = _Checker(f"agent file {path}")
        check.like(actor, policy.actor.state_dict(), "actor", bound=PARAMETER_BOUND)
        policy.actor.load_state_dict(actor)  # checked: the actor's own keys and shapes
        return policy

    def act(self, state: torch.Tensor) -> int:
        """The action of highest probability at `state` (ties: the lowest index)."""
        with torch.no_grad():
            return int(self.actor(state.unsqueeze(0))[0].argmax())


def check_agent_file(path: Path, config: SACConfig, meta: Mapping[str, Any] | None) -> None:
    """A file to start an agent from and save it back to: a usable agent where one is,
    else a directory to write it in; never a link, which the save-back would write through."""
    require_writable(path)
    require_writable(path.with_name(path.name + ".tmp"))
    if path.exists() or path.is_symlink():
        SACDiscrete(config, 0).load(path, meta)
    elif not path.parent.is_dir():
        raise AgentFileError(f"agent file {path}: its directory does not exist")


def _sizes(config: SACConfig) -> dict[str, int]:
    """What fixes the networks' shapes."""
    return {
        "state_dim": config.state_dim,
        "num_actions": config.num_actions,
        "hidden": config.hidden,
    }


def _write(
    path: str | Path, kind: str, config: SACConfig, meta: Mapping[str, Any] | None, body: Any
) -> None:
    """`body` under a header of its kind, sizes and meta, written to a temporary file that
    then replaces `path`, so a reader never sees half a file."""
    payload = {"kind": kind, "sizes": _sizes(config), "meta": dict(meta or {}), "body": body}
    write_atomic(path, lambda f: torch.save(payload, f))


def _read(
    path: str | Path, kinds: tuple[str, ...], config: SACConfig, meta: Mapping[str, Any] | None
) -> Any:
    """The body of a file of one of `kinds` saved for these sizes and meta."""
    check = _Checker(f"agent file {path}")
    try:
        with open_regular(path) as f:
            payload = torch.load(f, weights_only=True)
    except Exception as err:  # a missing file, a FIFO, a pickle with code: one line each
        raise check.error(f"cannot be read: {_first_line(err)}") from None
    if not isinstance(payload, dict) or payload.get("kind") not in kinds:
        raise check.error(f"not a file of kind {' or '.join(kinds)}")
    if payload.get("sizes") != _sizes(config):
        raise check.error(f"saved for {payload.get('sizes')}, this run needs {_sizes(config)}")
    if payload.get("meta") != dict(meta or {}):
        raise check.error(f"saved for {payload.get('meta')}, this run has {dict(meta or {})}")
    return payload.get("body")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _step(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> bool:
    """One optimiser step on `loss`, taken only where the loss and every gradient are
    finite (an overflow never reaches the weights); whether it was taken."""
    optimizer.zero_grad()
    if not bool(torch.isfinite(loss)):
        return False
    loss.backward()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    if not all(g is None or bool(torch.isfinite(g).all()) for g in grads):
        optimizer.zero_grad()
        return False
    optimizer.step()
    return True


def _adam_ratio(betas: tuple[float, float]) -> float:
    """The most |m| / sqrt(v) Adam's moments reach from any gradients: by Cauchy-Schwarz,
    (1 − β1) / sqrt((1 − β2)(1 − β1²/β2)) (7.3 for the defaults), where β1² < β2."""
    beta1, beta2 = betas
    if beta1**2 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1**2 / beta2))


class _Checker:
    """Kind, shape, finiteness and bound checks of a loaded state's parts against the
    live agent's."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, reason: str) -> AgentFileError:
        return AgentFileError(f"{self.source}: {reason}")

    def like(self, value: Any, template: Any, where: str, bound: float = math.inf) -> None:
        """`value` has `template`'s structure: the same keys, tensors of the same dtype and
        shape (floating ones finite and within ±`bound`), numbers where it has numbers."""
        if isinstance(template, torch.Tensor):
            ok = isinstance(value, torch.Tensor) and value.dtype == template.dtype
            if not ok or value.shape != template.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise self.error(f"{where} is {shape}, expected {tuple(template.shape)}")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise self.error(f"{where} has NaN or Inf values")
            if value.is_floating_point() and value.numel() and float(value.abs().max()) > bound:
                raise self.error(f"{where} has values beyond ±{bound:g}")
        elif isinstance(template, Mapping):
            if not isinstance(value, Mapping) or set(value) != set(template):
                raise self.error(f"{where} does not have the expected entries")
            for key in template:
                self.like(value[key], template[key], f"{where}.{key}", bound)
        elif isinstance(template, int | float) and not _is_number(value):
            raise self.error(f"{where} is not a number")

    def adam(self, saved: Any, optimizer: torch.optim.Optimizer, where: str) -> dict[Any, Any]:
        """The per-parameter moments of a saved Adam state: none (never stepped) or, for
        every parameter, a step count and two moments of its shape."""
        moments = saved.get("state") if isinstance(saved, Mapping) else None
        if not isinstance(moments, Mapping):
            raise self.error(f"{where} has no optimiser state")
        if not moments:
            return {}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        template = {
            i: {"step": torch.zeros(()), "exp_avg": p.detach(), "exp_avg_sq": p.detach()}
            for i, p in enumerate(params)
        }
        self.like(moments, template, f"{where}.state")
        ratio = _adam_ratio(optimizer.param_groups[0]["betas"])
        for i, moment in moments.items():
            step, m, v = moment["step"], moment["exp_avg"], moment["exp_avg_sq"]
            if not 0 <= float(step) <= 2**53 or float(step) != math.floor(float(step)):
                raise self.error(f"{where}.state.{i}.step {float(step):g} is not a count >= 0")
            if not bool((v >= 0).all()):
                raise self.error(f"{where}.state.{i}.exp_avg_sq has negative values")
            if not bool((m.abs() <= ratio * v.sqrt() * 1.001 + 1e-12).all()):
                raise self.error(f"{where}.state.{i}.exp_avg exceeds what its exp_avg_sq allows")
        return dict(moments)

    def buffer(self, saved: Any, config: SACConfig) -> None:
        """Transitions of the agent's sizes, no more than it holds, actions in range."""
        if not isinstance(saved, Mapping) or not isinstance(saved.get("actions"), torch.Tensor):
            raise self.error("buffer does not have the expected entries")
        n = len(saved["actions"])
        if n > config.buffer_size:
            raise self.error(f"buffer holds {n} transitions, more than {config.buffer_size}")
        template = {
            "states": torch.zeros(n, config.state_dim),
            "actions": torch.zeros(n, dtype=torch.int64),
            "rewards": torch.zeros(n),
            "next_states": torch.zeros(n, config.state_dim),
            "dones": torch.zeros(n),
            "position": 0,
        }
        self.like(saved, template, "buffer")
        for name in ("states", "next_states"):
            self.like(saved[name], template[name], f"buffer.{name}", bound=STATE_BOUND)
        self.like(saved["rewards"], template["rewards"], "buffer.rewards", config.reward_bound)
        if n and not bool(((saved["dones"] == 0) | (saved["dones"] == 1)).all()):
            raise self.error("buffer.dones holds values other than 0 and 1")
        actions, position = saved["actions"], saved["position"]
        if n and not bool(((actions >= 0) & (actions < config.num_actions)).all()):
            raise self.error("buffer holds actions out of range")
        if not isinstance(position, int) or not 0 <= position < max(config.buffer_size, 1):
            raise self.error(f"buffer position {position!r} is out of range")
