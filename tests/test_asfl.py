"""ASFL mechanics on hand-built cases (lag tolerance, cache merge, policies, SAC), end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_fl, without_wall_time

from fl.mechanisms.sac import SACConfig, SACDiscrete
from fl.strategy.server import ClientUpdate, ReplyInfo
from fl.world.population import NodeIds
from strategies.asfl import (
    ASFLParams,
    ASFLServer,
    CacheEntry,
    deprecate,
    merge_cache,
    selection_scores,
    top_k,
)
from strategies.fedbuff import FedBuffParams, FedBuffServer


def _update(node: int, staleness: int, value: float, examples: int = 10) -> ClientUpdate:
    return ClientUpdate(node, torch.full((3,), value), examples, {}, staleness=staleness)


def _server(**params: object) -> ASFLServer:
    return ASFLServer(ASFLParams(**params), seed=0, clients_per_round=10)  # type: ignore[arg-type]


def test_replies_and_entries_staler_than_the_lag_tolerance_never_merge():
    cache = {
        7: CacheEntry(torch.zeros(3), 5, version=6),  # lag 4 at round 10: evicted
        8: CacheEntry(torch.zeros(3), 5, version=8),  # lag 2: kept
        1: CacheEntry(torch.zeros(3), 5, version=9),  # its new reply is deprecated: dropped
    }
    updates = [_update(1, 3, 1.0), _update(2, 2, 2.0), _update(3, 0, 3.0)]
    tolerated = deprecate(cache, updates, server_round=10, tolerance=2)
    assert [u.node_id for u in tolerated] == [2, 3]
    assert sorted(cache) == [8]


def test_cache_merge_weighs_examples_and_staleness_by_the_formula():
    cache = {
        1: CacheEntry(torch.tensor([1.0, 0.0]), 30, version=10),  # lag 0
        2: CacheEntry(torch.tensor([0.0, 4.0]), 10, version=7),  # lag 3
    }
    assert torch.allclose(merge_cache(cache, 10, 0.0), torch.tensor([0.75, 1.0]))  # SAFA: n_k/n
    w1, w2 = 30 * 1.0, 10 * (1 + 3) ** -0.5  # n_k (1 + lag)^-a, a = 0.5
    expected = torch.tensor([w1, 4 * w2]) / (w1 + w2)
    assert torch.allclose(merge_cache(cache, 10, 0.5), expected)


def test_aggregate_caches_the_model_the_client_trained_and_reports_lags():
    server = _server(policy="fixed", fixed_quota=0.5, fixed_lag=1)
    server.global_vector = torch.full((3,), 10.0)
    old_base = torch.full((3,), 4.0)
    server.expect(
        {
            1: ReplyInfo(sent_round=5, staleness=0, arrived_s=1.0, base=server.global_vector),
            2: ReplyInfo(sent_round=4, staleness=1, arrived_s=2.0, base=old_base),
            3: ReplyInfo(sent_round=2, staleness=3, arrived_s=3.0, base=old_base),
        }
    )
    server.on_round_start(5)
    # vectors as check_reply leaves them: undiscounted steps on today's global
    updates = [_update(1, 0, 11.0), _update(2, 1, 12.0), _update(3, 3, 99.0)]
    merged = server.aggregate(5, updates)
    assert torch.equal(server.cache[2].vector, torch.full((3,), 6.0))  # its base 4 + step 2
    assert server.cache[2].version == 4 and 3 not in server.cache
    assert torch.allclose(merged, torch.full((3,), 8.5))  # (11 + 6) / 2
    diag = server.diagnostics()
    assert diag["deprecated"] == 1 and diag["cache_lag_max"] == 1 <= diag["lag_tolerance"]
    assert diag["quota_k"] == 5 == server.arrivals_to_close(5)


def test_rebase_leaves_stale_steps_whole_for_the_cache_merge():
    server = _server()
    server.global_vector = torch.ones(2)
    assert torch.equal(server.rebase(torch.full((2,), 2.0), 4), torch.full((2,), 3.0))


def test_fixed_policy_keeps_its_grid_point_and_random_is_seeded_uniform():
    fixed = _server(policy="fixed", fixed_quota=0.3, fixed_lag=4)
    for rnd in range(1, 6):
        fixed.on_round_start(rnd)
        assert (fixed.quota, fixed.lag_tolerance) == (3, 4)
    picks = []
    for _ in range(2):
        rand = _server(policy="random")
        seen = []
        for rnd in range(1, 501):
            rand.on_round_start(rnd)
            seen.append(rand.action)
        picks.append(seen)
    assert picks[0] == picks[1]  # seeded
    counts = torch.bincount(torch.tensor(picks[0]), minlength=25)
    assert len(counts) == 25 and counts.min() > 5 and counts.max() < 40  # ~20 each


def test_reward_is_the_latency_accuracy_objective_per_round():
    server = _server(policy="fixed", preference=0.25, horizon=10)
    server.on_round_start(1)
    server.ref_round_s = 4.0  # the slowest reply seen took 4 s
    server.on_round_end(1, accuracy=0.5, loss=1.0, virtual_time_s=2.0)
    assert server.diagnostics()["reward"] == pytest.approx(-0.75 * 2.0 / 40)  # no ΔAcc yet
    server.on_round_start(2)
    server.on_round_end(2, accuracy=0.7, loss=0.8, virtual_time_s=3.0)
    assert server.diagnostics()["reward"] == pytest.approx(0.25 * 0.2 - 0.75 * 1.0 / 40)
    assert server.features.shape == (10,) and server.features[0] == pytest.approx(0.2)


def test_selection_explores_unseen_nodes_then_prefers_lossy_big_fast_ones():
    seen = {1: [2.0, 10, 1.0], 2: [1.0, 10, 1.0], 3: [1.0, 10, 5.0]}
    scores = selection_scores([1, 2, 3, 4], seen)
    assert scores[3] == math.inf and scores[0] > scores[1] > scores[2]
    server = _server()
    server.seen = seen
    server.plan(2)
    assert server.select(1, [1, 2, 3, 4]) == [1, 4]


def test_top_k_takes_what_a_full_sort_by_score_then_jitter_takes():
    rng = np.random.default_rng(0)
    for trial in range(500):
        n = int(rng.integers(1, 40))
        k = int(rng.integers(0, n + 1))
        levels = np.array([-1.0, 0.5, 2.0, math.inf])  # ties, as unseen nodes (+inf) are
        scores = rng.choice(levels, size=n) if trial % 2 else rng.random(n)
        jitter = rng.random(n)
        full_sort = sorted(range(n), key=lambda i: (-scores[i], jitter[i]))[:k]
        assert top_k(scores, jitter, k).tolist() == sorted(full_sort), (scores, jitter, k)


def test_selection_in_a_population_takes_the_unseen_then_the_best_seen():
    """200,000 candidates as NodeIds, 300 heard from: the seeded choice of the sort rule,
    without a Python step per candidate."""
    ids = np.arange(10, 200_010, dtype=np.uint64)
    rng = np.random.default_rng(1)
    seen_at = rng.choice(len(ids), size=300, replace=False)
    server = _server()
    server.seen = {int(ids[i]): [float(rng.random()), 10, float(rng.random())] for i in seen_at}
    server.plan(len(ids) - 250)  # every unseen node and the 50 best seen ones
    picked = server.select(3, NodeIds(ids))
    scores = selection_scores(NodeIds(ids), server.seen)
    best_seen = sorted(seen_at, key=lambda i: -scores[i])[:50]
    unseen = np.setdiff1d(np.arange(len(ids)), seen_at)
    assert picked == sorted(int(ids[i]) for i in [*unseen, *best_seen])


def test_sac_networks_have_the_right_shapes_and_a_step_lowers_the_critic_loss():
    agent = SACDiscrete(SACConfig(state_dim=4, num_actions=6, lr=1e-2), seed=3)
    probs, log_probs = agent.policy(torch.zeros(5, 4))
    assert probs.shape == log_probs.shape == (5, 6)
    assert torch.allclose(probs.sum(-1), torch.ones(5))
    assert agent.critics[0](torch.zeros(2, 4)).shape == (2, 6)
    g = torch.Generator().manual_seed(0)
    batch = {
        "states": torch.rand(32, 4, generator=g),
        "actions": torch.randint(6, (32,), generator=g),
        "rewards": torch.rand(32, generator=g),
        "next_states": torch.rand(32, 4, generator=g),
    }
    with torch.no_grad():
        before = float(agent.critic_loss(batch))
    for _ in range(20):
        agent.learn(batch)
    with torch.no_grad():
        assert float(agent.critic_loss(batch)) < 0.5 * before


def test_sac_is_seeded_and_its_state_round_trips():
    def trained(seed: int) -> SACDiscrete:
        agent = SACDiscrete(SACConfig(state_dim=3, num_actions=4, batch_size=4), seed=seed)
        for i in range(6):
            agent.remember(
                torch.full((3,), i / 6), agent.act(torch.zeros(3)), 0.1 * i, torch.ones(3)
            )
            agent.update()
        return agent

    a, b, c = trained(1), trained(1), trained(2)
    assert torch.equal(a.actor[0].weight, b.actor[0].weight)
    assert not torch.equal(a.actor[0].weight, c.actor[0].weight)
    c.load_state_dict(a.state_dict())
    assert [a.act(torch.ones(3)) for _ in range(20)] == [c.act(torch.ones(3)) for _ in range(20)]
    assert a.update() == c.update()


def test_fedbuff_moves_the_model_by_the_server_step():
    server = FedBuffServer(FedBuffParams(server_lr=0.5), seed=0, clients_per_round=2)
    server.global_vector = torch.zeros(3)
    merged = server.aggregate(1, [_update(1, 0, 2.0), _update(2, 0, 4.0)])
    assert torch.allclose(merged, torch.full((3,), 1.5))


RUN = (
    "strategy=asfl",
    "loop=semi_async",
    "system=heterogeneous",
    "clients_per_round=6",
    "num_clients=10",
    "local_epochs=1",
    "strategy.batch_size=4",
    "strategy.quotas=[0.2,0.5]",
    "strategy.lags=[0,2]",
    "strategy.fixed_quota=0.5",
    "strategy.fixed_lag=2",
    "strategy.horizon=8",
    "progress=false",
)


@pytest.mark.slow  # an end-to-end run with resume (~20 s); the mechanics have fast tests
def test_asfl_run_logs_reward_action_critic_loss_and_resumes_identically(tmp_path):
    run_fl(tmp_path / "full", *RUN, "rounds=8", fresh=True)
    rows = read_metrics(tmp_path / "full")
    assert all(r["rejected"] == 0 and r["failed"] == 0 for r in rows)
    assert all(r["quota_k"] == r["replies"] for r in rows)  # each round closes at K_t
    assert all(r["cache_lag_max"] <= r["lag_tolerance"] for r in rows)
    assert all(isinstance(r["reward"], float) and 0 <= r["action"] < 4 for r in rows)
    assert rows[0]["critic_loss"] is None and isinstance(rows[-1]["critic_loss"], float)
    assert len({r["action"] for r in rows}) > 1
    assert rows[-1]["accuracy"] > 0.3

    run_fl(tmp_path / "resumed", *RUN, "rounds=5")
    run_fl(tmp_path / "resumed", *RUN, "rounds=8", "resume=true")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(rows)


SAFA = (
    "strategy=safa",  # with SAFA's forced resync and CFCFM (tests/test_safa.py)
    "system=heterogeneous",
    "clients_per_round=6",
    "num_clients=10",
    "local_epochs=1",
    "strategy.fixed_lag=1",
    "strategy.horizon=8",
    "progress=false",
)


@pytest.mark.slow  # end to end with resume (~15 s)
def test_safa_resumes_identically_across_resyncs_and_undrafted_replies(tmp_path):
    run_fl(tmp_path / "full", *SAFA, "rounds=8", fresh=True)
    rows = read_metrics(tmp_path / "full")
    assert any(r["resynced"] for r in rows[3:]) and any(r["undrafted"] for r in rows[3:])
    run_fl(tmp_path / "resumed", *SAFA, "rounds=3")
    run_fl(tmp_path / "resumed", *SAFA, "rounds=8", "resume=true")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(rows)
