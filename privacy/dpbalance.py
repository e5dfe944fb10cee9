"""DPBalance privacy-budget scheduling (Liu et al., INFOCOM 2024) and its DPF, DPK, FCFS baselines.

Data blocks carry ε budgets; analysts submit FL pipelines that demand ε on blocks. A
scheduler turns the waiting pipelines into grants: a pipeline is served all-or-nothing,
with κ ≥ 1 times its demand on every block it asked for ("one-or-more", Def. 7).

DPBalance (Algorithm 1) works in two steps. Sub-problem 1 shares the blocks among
analysts by maximising the platform utility Ψ_λ = f_β · (Σ U_i)^(±λ) over continuous
analyst shares x_i (solved with SLSQP, the Lagrange-multiplier step); step 2 serves,
inside each analyst's share, the largest number of its pipelines and then the most
utility (two small MILPs, HiGHS), returning what is left to the pool.

Choices the paper leaves open are marked [R] and listed in docs/PRIVACY.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp, minimize

__all__ = [
    "DPF",
    "DPK",
    "FCFS",
    "SCHEDULERS",
    "Block",
    "DPBalance",
    "Grant",
    "Pipeline",
    "Problem",
    "Scheduler",
    "analyst_shares",
    "dominant_fairness",
    "make_scheduler",
    "round_utilities",
    "waiting_factor",
]

TOL = 1e-9  # slack kept below every capacity, so float rounding can never overshoot a budget


@dataclass(frozen=True)
class Block:
    """A data block: its total ε budget, what is not yet allocated, and DPF's arrival count."""

    id: str
    budget: float
    available: float
    arrivals: int = 0  # pipelines that have demanded this block so far (DPF-N unlocking)


@dataclass(frozen=True)
class Pipeline:
    """A waiting FL pipeline: its analyst, ε demand per block, arrival time and loss weight."""

    id: str
    analyst: str
    demand: Mapping[str, float]
    arrival: float = 0.0
    loss: float = 1.0  # l_ij: data-model matching degree; 1.0 (neutral) before training [R]


@dataclass(frozen=True)
class Problem:
    """One scheduling round: the blocks and the waiting pipelines (in arrival order)."""

    blocks: Mapping[str, Block]
    pipelines: Sequence[Pipeline]
    now: float = 0.0


@dataclass(frozen=True)
class Grant:
    """A served pipeline: κ ≥ 1 and the ε it gets on each block (κ times its demand)."""

    pipeline: str
    kappa: float
    epsilon: dict[str, float]


class Scheduler(Protocol):
    """Turns one round's waiting pipelines into grants that fit the available budgets."""

    name: str

    def allocate(self, problem: Problem) -> list[Grant]: ...


def waiting_factor(wait_s: float, t0: float) -> float:
    """T(t) = 1 / (1 + t / t0): any decreasing function of waiting time will do [R]."""
    return 1.0 / (1.0 + max(wait_s, 0.0) / t0)


def _grant(pipeline: Pipeline, kappa: float) -> Grant:
    return Grant(pipeline.id, kappa, {b: kappa * e for b, e in pipeline.demand.items()})


def _fits(demand: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(e <= free.get(b, 0.0) + TOL * 1e-3 for b, e in demand.items())


def _take(demand: Mapping[str, float], free: dict[str, float]) -> None:
    for b, e in demand.items():
        free[b] -= e


def _dominant_share(pipeline: Pipeline, blocks: Mapping[str, Block]) -> float:
    return max((e / blocks[b].budget for b, e in pipeline.demand.items()), default=0.0)


# ----- sub-problem 1: analyst shares ---------------------------------------------------


def _fds_objective(
    u: np.ndarray, beta: float, lam: float | None
) -> tuple[float, np.ndarray | None]:
    """F(U) to maximise (a monotone transform of Ψ_λ) and its gradient where closed-form.

    `lam=None` is the α-fair special case λ = |(1-β)/β| (Eq. 11-12), concave and smooth.
    Otherwise Ψ_λ = f_β · S^(sgn(1-β)·λ): the paper prints S^λ, which for β > 1 (f_β < 0)
    would reward *less* utility; with the sign folded in, λ ≥ 0 is an efficiency
    preference for every β and λ = |(1-β)/β| gives back Eq. 11 exactly [R].
    """
    if lam is None:
        if beta == 1:
            return float(np.sum(np.log(u))), 1.0 / u
        return float(np.sum(u ** (1 - beta)) / (1 - beta)), u ** (-beta)
    total = float(u.sum())
    p = u / total
    if beta == 1:  # the β → 1 limit of f_β: exp(entropy of the shares)
        fairness = float(-np.sum(p * np.log(p)))
    else:
        fairness = math.copysign(1.0, 1 - beta) * math.log(float(np.sum(p ** (1 - beta)))) / beta
    return fairness + lam * math.log(total), None


def analyst_shares(
    demand: np.ndarray,
    weight: np.ndarray,
    capacity: np.ndarray,
    *,
    beta: float,
    lam: float | None = None,
) -> np.ndarray:
    """Sub-problem 1 (Eqs. 17-19): continuous x_i maximising Ψ_λ s.t. demand^T x ≤ capacity.

    `demand[i, k]` is analyst i's aggregated normalised demand γ_i^<k>, `weight[i]` is
    μ_i·T(t_i)·l_i (so U_i = weight_i·x_i), `capacity[k]` the free fraction of block k.
    β = 0 or λ = ∞ maximise Σ U_i (a linear programme); λ = 0 only fixes the ratios of
    the U_i, and the shares are then scaled up until a block is full (Pareto) [R].
    """
    n = len(weight)
    if n == 0:
        return np.zeros(0)
    used = demand.sum(axis=0) > 0
    a, cap = demand[:, used], np.maximum(capacity[used] * (1 - TOL), 0.0)
    with np.errstate(divide="ignore"):
        upper = np.min(np.where(a > 0, cap / a, np.inf), axis=1)
    if beta == 0 or (lam is not None and math.isinf(lam)):
        res = linprog(-weight, A_ub=a.T, b_ub=cap, bounds=list(zip([0.0] * n, upper, strict=True)))
        return _feasible(np.asarray(res.x), a, cap)
    # start from equal utilities, scaled until a block is full: feasible and interior in x
    unit = float(np.min(cap / np.maximum((a / weight[:, None]).sum(axis=0), 1e-300)))
    x0 = unit / weight
    if unit <= 0:
        return np.zeros(n)

    def negative(x: np.ndarray) -> tuple[float, np.ndarray]:
        u = weight * x / unit
        value, grad_u = _fds_objective(u, beta, lam)
        if grad_u is None:
            return -value, _numeric_gradient(lambda y: _fds_objective(y, beta, lam)[0], u) * (
                -weight / unit
            )
        return -value, -grad_u * weight / unit

    res = minimize(
        negative,
        x0,
        jac=True,
        method="SLSQP",
        bounds=Bounds(x0 * 1e-9, np.maximum(upper, x0)),
        constraints=[LinearConstraint(a.T, -np.inf, cap)],
        options={"maxiter": 500, "ftol": 1e-14},
    )
    x = np.asarray(res.x)
    if lam == 0:  # Ψ_0 is scale-free: take the largest allocation with the same ratios
        load = a.T @ x
        x = x * float(np.min(np.where(load > 0, cap / np.maximum(load, 1e-300), np.inf)))
    return _feasible(x, a, cap)


def _numeric_gradient(f: Callable[[np.ndarray], float], u: np.ndarray) -> np.ndarray:
    """Central differences (only the general-λ objective needs them)."""
    grad = np.zeros_like(u)
    for i in range(len(u)):
        h = 1e-7 * max(abs(u[i]), 1.0)
        up, down = u.copy(), u.copy()
        up[i] += h
        down[i] = max(down[i] - h, 1e-12)
        grad[i] = (f(up) - f(down)) / (up[i] - down[i])
    return grad


def _feasible(x: np.ndarray, a: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Undo solver round-off: scale shares down until no block is overfilled."""
    x = np.maximum(x, 0.0)
    load = a.T @ x
    if np.any((cap <= 0) & (load > 0)):
        return np.zeros_like(x)
    ratio = np.divide(load, cap, out=np.zeros_like(load), where=cap > 0)
    over = float(ratio.max(initial=0.0))
    return x / over if over > 1 else x


# ----- step 2: pipelines inside an analyst's share ---------------------------------------


def _serve_within(
    gamma: np.ndarray, weight: np.ndarray, share: np.ndarray, kappa_max: float | None = None
) -> np.ndarray:
    """κ per pipeline (0 = not served): most pipelines first (Eqs. 23-24), then most utility.

    Among equally many pipelines the MILP picks the set with the highest Σ μ_ij κ_ij T l
    (Eqs. 20-22, with the share as an upper bound rather than the printed equality, which
    a single pipeline could not meet); remaining ties go to the earlier arrival [R].
    """
    n = len(weight)
    used = gamma.sum(axis=0) > 0
    g, s = gamma[:, used], np.maximum(share[used] * (1 - TOL), 0.0)
    if n == 0 or not bool(np.all(g.sum(axis=1) > 0)):
        return np.zeros(n)
    options = {"mip_rel_gap": 1e-9, "presolve": True}
    count = milp(
        -np.ones(n),
        constraints=LinearConstraint(g.T, -np.inf, s),
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        options=options,
    )
    served = round(-count.fun) if count.success else 0
    if served == 0:
        return np.zeros(n)
    with np.errstate(divide="ignore"):
        upper = np.min(np.where(g > 0, s / g, np.inf), axis=1)
    upper = np.maximum(upper, 1.0) if kappa_max is None else np.clip(upper, 1.0, kappa_max)
    tie = 1e-7 * float(weight.max()) * (n - np.arange(n)) / n
    eye = np.eye(n)
    constraints = [
        LinearConstraint(np.hstack([g.T, np.zeros((g.shape[1], n))]), -np.inf, s),
        LinearConstraint(np.hstack([eye, -eye]), 0, np.inf),  # κ_j ≥ 1 when served
        LinearConstraint(np.hstack([eye, -np.diag(upper)]), -np.inf, 0),  # κ_j = 0 otherwise
        LinearConstraint(np.hstack([np.zeros(n), np.ones(n)])[None, :], served, served),
    ]
    res = milp(
        -np.concatenate([weight, tie]),
        constraints=constraints,
        integrality=np.concatenate([np.zeros(n), np.ones(n)]),
        bounds=Bounds(0, np.concatenate([upper, np.ones(n)])),
        options=options,
    )
    if not res.success:
        return np.zeros(n)
    kappa, chosen = res.x[:n], res.x[n:] > 0.5
    return np.where(chosen, np.maximum(kappa, 1.0), 0.0)


# ----- schedulers ------------------------------------------------------------------------


@dataclass
class DPBalance:
    """Algorithm 1: Lagrange step for analyst shares, then greedy service inside each share."""

    beta: float = 2.2
    lam: float | None = None  # None: λ = |(1-β)/β|, the α-fair form (Eq. 11)
    t0: float = 10.0  # waiting-time scale of T(t), one scheduling period [R]
    printed_capacity: bool = False  # True: Eq. 14 as printed, with T·l inside the constraint
    kappa_max: float | None = None  # cap on κ; None: unbounded, as in the paper [R]
    name: str = "dpbalance"

    def allocate(self, problem: Problem) -> list[Grant]:
        """Grants for this round; unused share stays in the pool for later rounds."""
        blocks = problem.blocks
        free = {b: blk.available for b, blk in blocks.items()}
        waiting = [p for p in problem.pipelines if p.demand and _fits(p.demand, free)]
        if not waiting:
            return []
        ids = sorted({b for p in waiting for b in p.demand})
        col = {b: k for k, b in enumerate(ids)}
        budget = np.array([blocks[b].budget for b in ids])
        gamma = np.zeros((len(waiting), len(ids)))
        for j, p in enumerate(waiting):
            for b, e in p.demand.items():
                gamma[j, col[b]] = e / budget[col[b]]
        capacity = np.array([free[b] for b in ids]) / budget
        analysts = sorted({p.analyst for p in waiting})
        rows = [[j for j, p in enumerate(waiting) if p.analyst == a] for a in analysts]
        mu_j = gamma.max(axis=1)
        t_j = np.array([waiting_factor(problem.now - p.arrival, self.t0) for p in waiting])
        l_j = np.array([p.loss for p in waiting])
        agg = np.array([gamma[r].sum(axis=0) for r in rows])
        mu_i = agg.max(axis=1)
        t_i = np.array([t_j[r].min() for r in rows])  # T of the analyst's longest wait
        l_i = np.array([np.sum(mu_j[r] * l_j[r]) / np.sum(mu_j[r]) for r in rows])  # Eq. 6
        scaled = agg * (t_i * l_i)[:, None] if self.printed_capacity else agg
        x = analyst_shares(scaled, mu_i * t_i * l_i, capacity, beta=self.beta, lam=self.lam)
        pool = capacity.copy()
        grants = []
        for i, r in enumerate(rows):
            share = np.minimum(agg[i] * x[i], pool)
            kappa = _serve_within(gamma[r], mu_j[r] * t_j[r] * l_j[r], share, self.kappa_max)
            for j, k in zip(r, kappa, strict=True):
                k = min(k, _room(gamma[j], pool))  # HiGHS meets constraints within its own
                if k >= 1.0:  # tolerance; the pool is met exactly, and all or nothing
                    grants.append(_grant(waiting[j], float(k)))
                    pool -= gamma[j] * k
        return grants


def _room(need: np.ndarray, pool: np.ndarray) -> float:
    """The largest κ with κ·need within `pool` on every block it needs (less TOL)."""
    where = need > 0
    return float(np.min(np.maximum(pool[where], 0.0) * (1 - TOL) / need[where]))


def _grant_in_order(pipelines: Sequence[Pipeline], free: dict[str, float]) -> list[Grant]:
    """Grant each pipeline its whole demand, in this order, while its blocks have budget."""
    grants = []
    for p in pipelines:
        if p.demand and _fits(p.demand, free):
            _take(p.demand, free)
            grants.append(_grant(p, 1.0))
    return grants


@dataclass
class DPF:
    """Dominant Private Block Fairness (Luo et al., OSDI'21), DPF-N unlocking.

    A block unlocks budget/N each time a pipeline demanding it arrives; waiting pipelines
    are served smallest dominant share first, all-or-nothing, from unlocked budget.
    """

    n: int = 100
    name: str = "dpf"

    def allocate(self, problem: Problem) -> list[Grant]:
        """Grants from unlocked budget, in ascending dominant share."""
        blocks = problem.blocks
        free = {
            b: min(blk.budget, blk.budget * blk.arrivals / self.n) - (blk.budget - blk.available)
            for b, blk in blocks.items()
        }
        order = sorted(
            enumerate(problem.pipelines), key=lambda jp: (_dominant_share(jp[1], blocks), jp[0])
        )
        return _grant_in_order([p for _, p in order], free)


@dataclass
class DPK:
    """DPack-style greedy knapsack: highest weight-to-demand ratio first, w = 1 [R]."""

    name: str = "dpk"

    def allocate(self, problem: Problem) -> list[Grant]:
        """Grants in descending efficiency 1 / Σ_k d_jk / c_k (c = remaining capacity)."""
        free = {b: blk.available for b, blk in problem.blocks.items()}

        def efficiency(p: Pipeline) -> float:
            cost = sum(e / free[b] if free[b] > 0 else math.inf for b, e in p.demand.items())
            return 1.0 / cost if cost > 0 else 0.0

        order = sorted(enumerate(problem.pipelines), key=lambda jp: (-efficiency(jp[1]), jp[0]))
        return _grant_in_order([p for _, p in order], free)


@dataclass
class FCFS:
    """First come, first served: arrival order, each pipeline that fits (no head-of-line block)."""

    name: str = "fcfs"

    def allocate(self, problem: Problem) -> list[Grant]:
        """Grants in arrival order."""
        free = {b: blk.available for b, blk in problem.blocks.items()}
        return _grant_in_order(problem.pipelines, free)


SCHEDULERS = ("dpbalance", "dpf", "dpk", "fcfs")


def make_scheduler(
    name: str,
    *,
    beta: float = 2.2,
    lam: float | None = None,
    t0: float = 10.0,
    kappa_max: float | None = None,
    n: int = 100,
) -> Scheduler:
    """A scheduler by name; DPBalance uses beta, lam, t0 and kappa_max, DPF uses n."""
    if name == "dpbalance":
        return DPBalance(beta=beta, lam=lam, t0=t0, kappa_max=kappa_max)
    if name == "dpf":
        return DPF(n=n)
    if name == "dpk":
        return DPK()
    if name == "fcfs":
        return FCFS()
    raise ValueError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")


# ----- metrics ---------------------------------------------------------------------------


def round_utilities(problem: Problem, grants: Sequence[Grant], t0: float) -> dict[str, float]:
    """U_i (Eq. 7) of every analyst with a waiting pipeline, for the grants of this round.

    U_i = T(t_i) · l_i · max_k Σ_j κ_ij γ_ij^<k>: the analyst's dominant share of what it
    was granted, weighted like the objective. Analysts granted nothing have U_i = 0.
    """
    blocks = problem.blocks
    by_id = {p.id: p for p in problem.pipelines}
    utilities: dict[str, float] = {}
    for analyst in sorted({p.analyst for p in problem.pipelines}):
        mine = [p for p in problem.pipelines if p.analyst == analyst]
        load: dict[str, float] = {}
        for g in grants:
            if by_id[g.pipeline].analyst == analyst:
                for b, e in g.epsilon.items():
                    load[b] = load.get(b, 0.0) + e / blocks[b].budget
        mu = [_dominant_share(p, blocks) for p in mine]
        loss = sum(m * p.loss for m, p in zip(mu, mine, strict=True)) / max(sum(mu), 1e-300)
        wait = min(waiting_factor(problem.now - p.arrival, t0) for p in mine)
        utilities[analyst] = wait * loss * max(load.values(), default=0.0)
    return utilities


def dominant_fairness(utilities: Sequence[float], beta: float, floor: float = 0.01) -> float:
    """f_β (Eq. 9) of the analysts' utilities; NaN when nobody got anything.

    An analyst granted nothing would make f_β = -∞ for β > 1, so shares are floored at
    `floor` (1 % of the round's utility) [R]. Larger is fairer for every β; at equal
    shares f_β = M for β < 1 and -M for β > 1 (M analysts).
    """
    u = np.asarray(utilities, dtype=float)
    if u.size == 0 or u.sum() <= 0:
        return math.nan
    p = np.maximum(u / u.sum(), floor)
    if beta == 1:
        return float(math.exp(-np.sum(p * np.log(p))))
    if beta == 0:
        return 1.0
    return math.copysign(1.0, 1 - beta) * float(np.sum(p ** (1 - beta))) ** (1 / beta)
