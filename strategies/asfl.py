"""ASFL: semi-asynchronous FL whose quota and lag tolerance a SAC-Discrete agent picks.

Yu et al., "ASFL: Adaptive Semi-asynchronous Federated Learning for Balancing Model
Accuracy and Total Latency in Mobile Edge Networks", ICPP 2023. Only the abstract could
be read (shared/specs/algorithms_b.md §1.1), so **every mechanic below is our
reconstruction** (spec §1.2–1.4, tagged [R] there): SAFA's semi-asynchronous protocol
(Wu et al., IEEE TC 2021) with an RL controller choosing its two knobs each round.

Protocol, on the `semi_async` loop (clients_per_round nodes stay in flight):

1. Controller: at the start of round t the policy picks an action a_t = (K_t, τ_t) from
   a grid of quotas (fractions of the nodes in flight) × lag tolerances (rounds).
   With `resync` (SAFA's forced resync, spec §1.2 step 1), nodes in flight whose base is
   older than t − τ_t are then cancelled (`resync`): idle, they may be sent W(t−1).
2. Device selection: idle nodes are ranked by last reported train loss (an Oort-style
   proxy for the label histograms the abstract alludes to), data share, and observed
   round duration (`selection=score`); nodes never heard from go first.
3. The round closes at the K_t-th arrival (`arrivals_to_close`); nodes still training
   keep going and land later, stale. With `cfcfm` (SAFA's compensatory
   first-come-first-merge, step 3) the nodes picked last round are a reserve
   (`reserve_arrivals`): their arrivals close the round only where the others in flight
   cannot fill K_t, and the K_t picked are the earliest of the others, topped up from the
   reserve in arrival order (`draft`); the rest are undrafted.
4. Lag tolerance: a reply staler than τ_t is deprecated (discarded; the node gets the
   current model when next selected). Without `resync` such a node is not interrupted:
   the loop lets it finish. Tolerated picked replies are written into the cache as the
   model the client trained (its base plus its update).
5. Cache merge: entries whose lag (rounds since their base) exceeds τ_t, and those of
   deprecated replies, are deprecated: evicted, or with `resync` set to W(t−1) at lag 0
   (SAFA's step 4, what a resynced node holds; the spec's rule, not an eviction). The new
   global model is the weighted mean of the cache, weights n_k·(1 + lag_k)^-a
   (a = `staleness_exponent`; 0 is SAFA's n_k/n, > 0 the spec's "ASFL+poly"). Undrafted
   replies enter the cache after the merge (SAFA's bypass, step 6): they count from the
   next round.
6. Reward (the latency–accuracy objective, telescoping over rounds):
   r_t = ρ·(Acc_t − Acc_{t−1}) − (1 − ρ)·ℓ_t / L_ref, with ℓ_t the round's virtual
   duration and L_ref = horizon × the slowest reply duration seen so far (our estimate
   of synchronous FedAvg's latency over the same rounds).

Policies: `sac` (SAC-Discrete, `fl.mechanisms.sac`, learning within the run; with
`agent_file` it starts from the agent saved there and saves it back when round `horizon`
ends, the episode's last transition marked terminal, so that the agent learns across runs:
the spec's training protocol, experiments/asfl_train.py), `trained` (a saved policy acting
greedily, the argmax of its actor, without learning: what the spec evaluates on held-out
seeds), `fixed` (the grid point (fixed_quota, fixed_lag): SAFA with `resync` and `cfcfm`,
`strategy=safa`) and `random` (uniform over the grid: the ablation that shows whether the
agent learned).
`resync` and `cfcfm` are off by default, which keeps `strategy=asfl` the protocol of the
issue-13 figures.
Everything, agent included, is in `state_dict()`, so a resumed run is bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl.common.checkpointable import checkpointable
from fl.common.seeding import derive_seed
from fl.mechanisms.sac import (
    STATE_BOUND,
    GreedyPolicy,
    SACConfig,
    SACDiscrete,
    check_agent_file,
)
from fl.strategy.client import ClientHooks
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.world.population import as_node_ids, member

POLICIES = ("sac", "fixed", "random", "trained")
SELECTIONS = ("score", "uniform")
STATE_DIM = 10  # features of `ASFLServer._features`


@dataclass
class ASFLParams:
    """The action grid, the objective's preference and the agent (spec §1.3, and below)."""

    policy: str = "sac"  # sac | fixed | random | trained
    policy_file: str | None = None  # policy=trained: the saved policy it acts with
    agent_file: str | None = None  # policy=sac: start from this agent; saved back at the end
    quotas: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.5, 1.0])
    lags: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    fixed_quota: float = 0.5  # policy=fixed: SAFA's C
    fixed_lag: int = 3  # policy=fixed: SAFA's τ
    preference: float = 0.5  # ρ: weight of accuracy against latency in the objective
    horizon: int = 100  # rounds of the task (conf: ${rounds}); scales time and L_ref
    staleness_exponent: float = 0.0  # a of the cache weights n_k (1 + lag)^-a; 0: SAFA
    selection: str = "score"  # score | uniform
    resync: bool = False  # SAFA's forced resync of deprecated nodes (spec §1.2 steps 1, 4)
    cfcfm: bool = False  # SAFA's compensatory first-come-first-merge (steps 3, 6)
    hidden: int = 64
    # The spec's lr 3e-4, batch 64, one update a round assume 150 offline episodes; this
    # agent learns online within one run, so it starts after 32 rounds and steps 4 times.
    lr: float = 1e-3
    gamma: float = 0.99
    polyak: float = 0.005
    batch_size: int = 32
    buffer_size: int = 100_000
    updates_per_round: int = 4
    target_entropy_ratio: float = 0.98  # target entropy = ratio · log |A| (SAC-Discrete's)
    reward_scale: float = 1.0  # the agent learns from scale · r_t (metrics log r_t itself)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"strategy.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"strategy.selection must be one of {SELECTIONS}")
        if not self.quotas or not all(0 < q <= 1 for q in self.quotas):
            raise ValueError("strategy.quotas must be fractions in (0, 1]")
        if not self.lags or not all(isinstance(t, int) and t >= 0 for t in self.lags):
            raise ValueError("strategy.lags must be non-negative integers")
        if self.fixed_quota not in self.quotas or self.fixed_lag not in self.lags:
            raise ValueError("strategy.fixed_quota/fixed_lag must be in quotas/lags")
        if not 0 <= self.preference <= 1:
            raise ValueError("strategy.preference must be in [0, 1]")
        if self.horizon < 1 or self.staleness_exponent < 0:
            raise ValueError("strategy.horizon must be >= 1, staleness_exponent >= 0")
        if min(self.hidden, self.batch_size, self.buffer_size, self.updates_per_round) < 1:
            raise ValueError("strategy.hidden/batch_size/buffer_size/updates_per_round >= 1")
        if not 0 < self.target_entropy_ratio <= 1 or not self.reward_scale > 0:
            raise ValueError("strategy.target_entropy_ratio in (0, 1], reward_scale > 0")
        if (self.policy == "trained") != (self.policy_file is not None):
            raise ValueError("strategy.policy_file is for policy=trained, which needs one")
        if self.agent_file is not None and self.policy != "sac":
            raise ValueError("strategy.agent_file is for policy=sac")
        if self.policy_file is not None:  # one line if it is missing, unsafe or another's
            GreedyPolicy.load(self.policy_file, self.sac_config(), self.meta)
        if self.agent_file is not None:
            check_agent_file(Path(self.agent_file), self.sac_config(), self.meta)

    def sac_config(self) -> SACConfig:
        """The agent's sizes and hyper-parameters."""
        return SACConfig(
            STATE_DIM,
            len(self.actions),
            hidden=self.hidden,
            lr=self.lr,
            gamma=self.gamma,
            polyak=self.polyak,
            batch_size=self.batch_size,
            buffer_size=self.buffer_size,
            target_entropy_ratio=self.target_entropy_ratio,
            reward_bound=1.001 * self.reward_scale,  # |r_t| <= 1 (ρ·gain, (1 − ρ)·ℓ/L_ref)
        )

    @property
    def meta(self) -> dict[str, Any]:
        """What an agent's actions mean, saved with it and checked on load."""
        return {"actions": [[q, t] for q, t in self.actions]}

    @property
    def actions(self) -> list[tuple[float, int]]:
        """The flattened action grid: (quota, lag tolerance), quota-major."""
        return [(q, t) for q in self.quotas for t in self.lags]


@checkpointable
@dataclass
class CacheEntry:
    """A node's latest tolerated model, its example count and its base round."""

    vector: torch.Tensor
    examples: int
    version: int  # the round whose global model the client trained from


def deprecate(
    cache: dict[int, CacheEntry],
    updates: list[ClientUpdate],
    server_round: int,
    tolerance: int,
    resync_to: torch.Tensor | None = None,
) -> list[ClientUpdate]:
    """Return the replies no staler than `tolerance`; deprecate the cache entries of nodes
    with a staler reply and the entries whose lag now exceeds it.

    A deprecated entry is dropped, or, with `resync_to` (SAFA's W(t−1): spec §1.2 step 4,
    what a resynced node now holds), replaced by that model at lag 0, its examples kept.
    """
    tolerated = [u for u in updates if u.staleness <= tolerance]
    stale = {u.node_id for u in updates if u.staleness > tolerance} & cache.keys()
    stale |= {n for n, e in cache.items() if server_round - e.version > tolerance}
    for node in stale:
        if resync_to is None:
            del cache[node]
        else:
            cache[node] = CacheEntry(resync_to, cache[node].examples, server_round)
    return tolerated


def draft(
    updates: list[ClientUpdate], picked_before: Collection[int], quota: int
) -> tuple[list[ClientUpdate], list[ClientUpdate]]:
    """SAFA's CFCFM (spec §1.2 step 3): the `quota` earliest arrivals of the nodes not
    picked last round, topped up with those picked last round in arrival order; the rest
    are undrafted. Returns (picked, undrafted)."""
    ranked = sorted(updates, key=lambda u: (u.node_id in picked_before, u.arrived_s))
    return ranked[:quota], ranked[quota:]


def merge_cache(cache: dict[int, CacheEntry], server_round: int, exponent: float) -> torch.Tensor:
    """Σ_k ω_k w_k / Σ_k ω_k over the cache, ω_k = n_k·(1 + lag_k)^-a (in float64)."""
    nodes = sorted(cache)
    weights = torch.tensor(
        [cache[n].examples * (1 + server_round - cache[n].version) ** -exponent for n in nodes],
        dtype=torch.float64,
    )
    stacked = torch.stack([cache[n].vector for n in nodes]).to(torch.float64)
    merged = (weights[:, None] * stacked).sum(0) / weights.sum()
    return merged.to(cache[nodes[0]].vector.dtype)


def selection_scores(candidates: Sequence[int], seen: dict[int, list[float]]) -> np.ndarray:
    """Device-selection score per candidate: loss/mean + examples/mean − duration/median
    over the nodes heard from; +inf for a node never heard from (explored first).
    Vectorised over the candidates, who may be a whole population; Python work only for
    the nodes heard from."""
    nodes = as_node_ids(candidates)
    scores = np.full(len(nodes), math.inf)
    if not seen:
        return scores
    heard = np.flatnonzero(member(nodes.ids, np.fromiter(seen, np.uint64, len(seen))))
    known = [seen[nodes[i]] for i in heard]  # in candidate order
    if not known:
        return scores
    loss = float(np.mean([k[0] for k in known])) or 1.0
    examples = float(np.mean([k[1] for k in known])) or 1.0
    duration = float(np.median([k[2] for k in known])) or 1.0
    scores[heard] = [k[0] / loss + k[1] / examples - k[2] / duration for k in known]
    return scores


def top_k(scores: np.ndarray, jitter: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k highest scores, ties broken by the lower jitter, ascending.

    The set a full sort by (−score, jitter) would take first, found by partitioning: a
    population's candidates are mostly unseen (+inf), so the ties are what is large.
    """
    if k <= 0:
        return np.zeros(0, dtype=np.intp)
    kth = np.partition(scores, len(scores) - k)[len(scores) - k]  # the k-th highest
    above = np.flatnonzero(scores > kth)
    tied = np.flatnonzero(scores == kth)
    need = k - len(above)
    if need < len(tied):
        tied = tied[np.argpartition(jitter[tied], need - 1)[:need]]
    return np.sort(np.concatenate([above, tied]))


class ASFLServer(ServerStrategy):
    """SAFA's cache protocol; a policy picks the quota K_t and lag tolerance τ_t."""

    params: ASFLParams
    loop_kinds = ("semi_async",)  # K_t is the arrivals that close a semi-async round
    reads_round_accuracy = True  # the reward: each round's accuracy gain
    state_attributes = (
        "cache",
        "seen",
        "round_start_s",
        "features",
        "action",
        "accuracy",
        "loss",
        "ref_round_s",
        "objective",
        "picked",
    )

    def __init__(self, params: ASFLParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        if self.aggregator.name != "mean":
            raise ValueError("aggregation: ASFL merges its cache itself; use aggregation=mean")
        self.actions = params.actions
        self.cache: dict[int, CacheEntry] = {}
        self.seen: dict[int, list[float]] = {}  # node -> [train loss, examples, duration s]
        self.round_start_s: dict[int, float] = {1: 0.0}
        self.features = torch.zeros(STATE_DIM)
        self.action = self.actions.index((params.fixed_quota, params.fixed_lag))
        self.accuracy: float | None = None
        self.loss: float | None = None
        self.ref_round_s = 0.0
        self.objective = 0.0
        self.picked: list[int] = []  # the nodes whose replies the last aggregation merged
        self._reserve: frozenset[int] = frozenset()  # this round's: picked last round
        self._started = 0  # the round whose action is chosen
        self.generator = torch.Generator().manual_seed(derive_seed(self.seed, 0xA5F1))
        self.agent: SACDiscrete | None = None
        self.trained: GreedyPolicy | None = None
        if params.policy == "sac":
            self.agent = SACDiscrete(params.sac_config(), derive_seed(self.seed, 0x5AC))
            if params.agent_file is not None and Path(params.agent_file).exists():
                self.agent.load(params.agent_file, params.meta)
        elif params.policy_file is not None:
            self.trained = GreedyPolicy.load(params.policy_file, params.sac_config(), params.meta)
        self._round: dict[str, Any] = {}  # this round's diagnostics

    # ----- the knobs ----------------------------------------------------------------
    @property
    def quota(self) -> int:
        """K_t: arrivals that close the round."""
        return max(1, math.ceil(self.actions[self.action][0] * self.clients_per_round))

    @property
    def lag_tolerance(self) -> int:
        """τ_t: the most rounds a merged model may lag behind."""
        return self.actions[self.action][1]

    def on_round_start(self, server_round: int) -> None:
        """The policy picks this round's (K_t, τ_t) from the state the last round left,
        once, whichever of `resync` and this comes first."""
        if self._started == server_round:
            return
        self._started = server_round
        if self.params.policy == "random":
            self.action = int(torch.randint(len(self.actions), (1,), generator=self.generator))
        elif self.agent is not None:
            self.action = self.agent.act(self.features)
        elif self.trained is not None:
            self.action = self.trained.act(self.features)
        self._reserve, self.picked = frozenset(self.picked), []
        self._round = {
            "deprecated": 0,
            "resynced": 0,
            "undrafted": 0,
            **self._cache_stats(server_round),
        }

    def arrivals_to_close(self, server_round: int) -> int | None:
        return self.quota

    def resync(self, server_round: int, in_flight: Mapping[int, int]) -> list[int]:
        """SAFA's forced resync (`resync`): nodes in flight whose base is older than
        t − τ_t are cancelled; their cache entries become W(t−1) at this round's merge."""
        self.on_round_start(server_round)  # τ_t first
        if not self.params.resync:
            return []
        gone = [n for n, sent in in_flight.items() if server_round - sent > self.lag_tolerance]
        self._round["resynced"] = len(gone)
        return gone

    def reserve_arrivals(self, server_round: int) -> frozenset[int]:
        """CFCFM (`cfcfm`): the nodes picked last round close the round only as a reserve."""
        return self._reserve if self.params.cfcfm else frozenset()

    # ----- device selection -----------------------------------------------------------
    def select(self, server_round: int, candidates: Sequence[int]) -> list[int]:
        """The `wanted` best-scoring idle nodes (ties: seeded), kept in candidate order."""
        if self.params.selection == "uniform":
            return super().select(server_round, candidates)
        k = min(self.clients_per_round if self.wanted is None else self.wanted, len(candidates))
        jitter = np.random.default_rng([self.seed, server_round, 0xA5F1]).random(len(candidates))
        best = top_k(selection_scores(candidates, self.seen), jitter, k)
        return [candidates[i] for i in best]

    # ----- merging ----------------------------------------------------------------------
    def rebase(self, delta: torch.Tensor, staleness: int) -> torch.Tensor:
        """Undiscounted: ASFL bounds staleness by τ_t and weighs it in its cache merge."""
        return self.global_vector + delta

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        """Deprecate replies and entries beyond τ_t, cache the picked replies, merge the
        cache; with `cfcfm`, cache the undrafted ones after the merge (bypass, step 6)."""
        for u in updates:  # what selection and the latency reference learn from a reply
            duration = u.arrived_s - self.round_start_s.get(server_round - u.staleness, 0.0)
            self.seen[u.node_id] = [
                float(u.metrics.get("train-loss", 0.0)),
                u.num_examples,
                duration,
            ]
            self.ref_round_s = max(self.ref_round_s, duration)
        resync_to = self.global_vector if self.params.resync else None
        tolerated = deprecate(self.cache, updates, server_round, self.lag_tolerance, resync_to)
        picked, undrafted = (
            draft(tolerated, self._reserve, self.quota) if self.params.cfcfm else (tolerated, [])
        )
        self._cache_replies(picked, server_round)
        self.picked = sorted(u.node_id for u in picked)
        self._round.update(
            deprecated=len(updates) - len(tolerated),
            undrafted=len(undrafted),
            **self._cache_stats(server_round),
        )
        merged = self.global_vector
        if self.cache:
            merged = merge_cache(self.cache, server_round, self.params.staleness_exponent)
        self._cache_replies(undrafted, server_round)
        return merged

    def _cache_replies(self, updates: list[ClientUpdate], server_round: int) -> None:
        """Each reply into the cache as the model its client trained: its base plus its
        own update, versioned by the round it was sent in."""
        for u in updates:
            model = self.base_of(u.node_id) + (u.vector - self.global_vector)
            self.cache[u.node_id] = CacheEntry(model, u.num_examples, server_round - u.staleness)

    def _cache_stats(self, server_round: int) -> dict[str, Any]:
        """Size of the cache and the lags of its entries at `server_round`."""
        lags = [server_round - e.version for e in self.cache.values()]
        return {
            "cache_size": len(self.cache),
            "cache_lag_max": max(lags, default=0),
            "cache_lag_mean": float(np.mean(lags)) if lags else 0.0,
        }

    # ----- reward, state, learning ----------------------------------------------------
    def on_round_end(
        self, server_round: int, accuracy: float, loss: float, virtual_time_s: float
    ) -> None:
        """Reward the round's action, observe the next state, train the agent."""
        duration = virtual_time_s - self.round_start_s.get(server_round, 0.0)
        self.round_start_s[server_round + 1] = virtual_time_s
        self.ref_round_s = max(self.ref_round_s, duration, 1e-9)
        rho = self.params.preference
        gain = 0.0 if self.accuracy is None else accuracy - self.accuracy
        latency_ref = self.params.horizon * self.ref_round_s
        reward = rho * gain - (1 - rho) * duration / latency_ref
        features = self._features(server_round, accuracy, loss, duration)
        self.objective += reward
        self._round.update(reward=reward, objective=self.objective)
        if self.agent is not None:
            scaled, end = self.params.reward_scale * reward, server_round == self.params.horizon
            self.agent.remember(self.features, self.action, scaled, features, end)
            learned = [self.agent.update() for _ in range(self.params.updates_per_round)]
            last = learned[-1]
            self._round["critic_loss"] = None if last is None else last["critic_loss"]
            self._round["alpha"] = self.agent.alpha
            if end and self.params.agent_file is not None:
                self.agent.save(self.params.agent_file, self.params.meta)
        self.features, self.accuracy, self.loss = features, accuracy, loss

    def _features(
        self, server_round: int, accuracy: float, loss: float, duration: float
    ) -> torch.Tensor:
        """The agent's state (§1.3), each feature scaled to about [0, 1] or [−1, 1]."""
        top = max(self.params.lags) or 1
        quota_i, lag_i = divmod(self.action, len(self.params.lags))
        return torch.tensor(
            [
                server_round / self.params.horizon,
                accuracy,
                _clip(10 * (accuracy - _or(self.accuracy, accuracy))),
                _clip(_or(self.loss, loss) - loss),
                min(duration / self.ref_round_s, 2.0) / 2,
                self._round.get("cache_lag_mean", 0.0) / top,
                self._round.get("cache_lag_max", 0) / top,
                self._round.get("deprecated", 0) / max(1, self.quota),
                quota_i / max(1, len(self.params.quotas) - 1),
                lag_i / max(1, len(self.params.lags) - 1),
            ],
            dtype=torch.float32,
        )

    # ----- diagnostics and resume -------------------------------------------------------
    def diagnostics(self) -> dict[str, Any]:
        return {
            **super().diagnostics(),
            "action": self.action,
            "quota_k": self.quota,
            "lag_tolerance": self.lag_tolerance,
            **self._round,
        }

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["generator"] = self.generator.get_state()
        if self.agent is not None:
            state["agent"] = self.agent.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The agent's checks (`SACDiscrete.checked`), the kernel's kinds and finiteness,
        then ASFL's own bounds; a failing one is a CheckpointError and the run stops."""
        agent = None
        if self.agent is not None:
            agent = self.agent.checked(state.get("agent"), "the agent")
        super().load_state_dict(state)  # kinds and finiteness, before our bounds
        self._check_bounds()
        self.generator.set_state(state["generator"])
        if self.agent is not None:
            self.agent.load_state_dict(agent)

    def _check_bounds(self) -> None:
        """Loaded values a run of ASFL can hold: an action of the grid, the agent's state
        vector within its bound, counts, versions, times and the accuracy in range."""
        if not isinstance(self.action, int) or not 0 <= self.action < len(self.actions):
            raise ValueError(f"strategy state: action {self.action!r} is not in the grid")
        if self.features.shape != (STATE_DIM,) or float(self.features.abs().max()) > STATE_BOUND:
            raise ValueError(
                f"strategy state: features are not {STATE_DIM} values within ±{STATE_BOUND:g}"
            )
        if self.accuracy is not None and not 0 <= self.accuracy <= 1:
            raise ValueError(f"strategy state: accuracy {self.accuracy!r} is not in [0, 1]")
        lengths = {e.vector.shape for e in self.cache.values() if isinstance(e, CacheEntry)}
        model = self.global_vector.shape if self.global_vector.numel() else None
        if len(lengths) > 1 or (model is not None and lengths - {model}):
            raise ValueError("strategy state: cache models are not all of the model's length")
        entries = self.cache.values()
        if not all(
            isinstance(e, CacheEntry) and e.examples >= 0 and e.version >= 0 for e in entries
        ):
            raise ValueError("strategy state: a cache entry has a negative count or version")
        if not all(len(v) == 3 and min(v[1:]) >= 0 for v in self.seen.values()):
            raise ValueError("strategy state: seen holds negative counts or durations")
        times = [self.ref_round_s, *self.round_start_s.values()]
        if not all(isinstance(t, int | float) and t >= 0 for t in times):
            raise ValueError("strategy state: a round time is negative")


def _clip(value: float) -> float:
    return min(max(value, -1.0), 1.0)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


STRATEGY = register("asfl", server=ASFLServer, client=ClientHooks, params=ASFLParams)
