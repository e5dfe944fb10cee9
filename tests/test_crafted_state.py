"""Crafted agent files and checkpointed strategy states: finite extremes and NaNs are
refused in one line before they reach a controller (issue 36, class 3)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fl_run_cmd, python_run, read_metrics, train_in_process

from fl.common.checkpointable import check_state_values
from fl.mechanisms.sac import AgentFileError, GreedyPolicy, SACConfig, SACDiscrete
from fl.run.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

CONFIG = SACConfig(state_dim=3, num_actions=4, batch_size=4, buffer_size=50, reward_bound=1.0)


def _trained() -> SACDiscrete:
    agent = SACDiscrete(CONFIG, seed=1)
    for i in range(8):
        state = torch.full((3,), i / 8)
        agent.remember(state, agent.act(state), 0.1 * i, torch.ones(3), done=i == 7)
        agent.update()
    return agent


def _scale_actor(factor: float):
    def edit(body: dict[str, Any]) -> None:
        for value in body["actor"].values():
            value.mul_(factor)

    return edit


def _set(part: str, key: str, value: Any):
    def edit(body: dict[str, Any]) -> None:
        body[part]["state"][0][key] = value

    return edit


ATTACKS = {
    "actor weights x1e30": (_scale_actor(1e30), "actor"),
    "actor weights x1e37": (_scale_actor(1e37), "actor"),
    "log_alpha = 100": (lambda b: b.update(log_alpha=torch.tensor([100.0])), "log_alpha"),
    "a negative Adam second moment": (
        lambda b: b["critic_optimizer"]["state"][0]["exp_avg_sq"].fill_(-1.0),
        "negative",
    ),
    "an Adam step count of -1": (_set("actor_optimizer", "step", torch.tensor(-1.0)), "step"),
    "an Adam first moment its second cannot allow": (
        lambda b: b["actor_optimizer"]["state"][0]["exp_avg"].fill_(1e30),
        "exp_avg",
    ),
    "a reward of 1e30": (lambda b: b["buffer"]["rewards"].fill_(1e30), "rewards"),
    "a state of 1e30": (lambda b: b["buffer"]["states"].fill_(1e30), "states"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_finite_extremes_in_an_agent_file_are_refused_in_one_line(attack, tmp_path: Path):
    path = tmp_path / "agent.pt"
    _trained().save(path)
    edit, named = ATTACKS[attack]
    payload = torch.load(path, weights_only=True)
    edit(payload["body"])
    torch.save(payload, path)
    with pytest.raises(AgentFileError) as err:
        SACDiscrete(CONFIG, 0).load(path)
    line = str(err.value)
    assert line.startswith(f"agent file {path}: ") and named in line and "\n" not in line
    if named == "actor":  # a policy is the actor alone: refused there too
        with pytest.raises(AgentFileError, match="beyond"):
            GreedyPolicy.load(path, CONFIG)


def test_an_honest_agent_still_loads_and_learns_on(tmp_path: Path) -> None:
    agent = _trained()
    agent.save(tmp_path / "agent.pt")
    copy = SACDiscrete(CONFIG, 0)
    copy.load(tmp_path / "agent.pt")
    assert agent.update() == copy.update() is not None


def test_a_step_whose_loss_overflows_is_not_taken() -> None:
    """The second guard: an agent whose state got past every check (here, set directly)
    keeps finite weights; the update that would overflow is skipped, not crashed on."""
    agent = _trained()
    with torch.no_grad():
        agent.log_alpha.fill_(100.0)  # α = e^100: every loss overflows
    before = {k: v.clone() for k, v in agent.actor.state_dict().items()}
    assert agent.update() is None
    assert all(torch.equal(before[k], v) for k, v in agent.actor.state_dict().items())
    assert agent.act(torch.zeros(3)) in range(4)


def test_the_generic_check_walks_containers_and_state_classes() -> None:
    from fl.mechanisms.speculation import Speculation

    spec = Speculation.fresh(torch.zeros(4))
    check_state_values("", {"control": [1, 2.0, {"x": spec}], "n": 3})  # finite: passes
    spec.slope[2] = math.nan
    with pytest.raises(ValueError, match=r"^strategy state: control\[2\]\.x\.slope has NaN"):
        check_state_values("", {"control": [1, 2.0, {"x": spec}]})
    with pytest.raises(ValueError, match="ref has NaN"):
        check_state_values("", {"ref": math.inf})


def test_a_declared_nan_sentinel_may_be_nan_but_never_infinite() -> None:
    """R2SP's spans: NaN is "not measured yet" (`nan_sentinels`); nowhere else."""
    check_state_values("", {"spans": {7: math.nan, 8: 1.5}}, nan_ok=("spans",))
    with pytest.raises(ValueError, match=r"^strategy state: spans\.7 has NaN"):
        check_state_values("", {"spans": {7: math.inf}}, nan_ok=("spans",))
    with pytest.raises(ValueError, match="batches"):
        check_state_values("", {"spans": {}, "batches": {7: math.nan}}, nan_ok=("spans",))


def test_a_sentinel_field_may_be_infinite_but_never_nan() -> None:
    from fl.mechanisms.diagnosis import PlateauDetector

    detector = PlateauDetector.fresh(3, window=2)  # low: +inf, "no minimum yet"
    check_state_values("", {"detector": detector})
    detector.low[1] = math.nan
    with pytest.raises(ValueError, match=r"detector\.low has NaN"):
        check_state_values("", {"detector": detector})
    detector.low[1] = 0.0
    detector.window = torch.full((3,), math.inf)  # not a sentinel field: refused
    with pytest.raises(ValueError, match=r"detector\.window"):
        check_state_values("", {"detector": detector})


ASFL = (
    "strategy=asfl",
    "system=heterogeneous",
    "clients_per_round=4",
    "num_clients=6",
    "local_steps=2",
    "strategy.batch_size=2",
    "strategy.quotas=[0.5,1.0]",
    "strategy.lags=[1,2]",
    "strategy.fixed_quota=0.5",
    "strategy.fixed_lag=2",
    "strategy.horizon=4",
    "plots=false",
)
FEDSU = (
    "strategy=fedsu",
    "strategy.ema=0.5",
    "strategy.linearity_threshold=0.3",
    "num_clients=6",
    "clients_per_round=4",
    "local_steps=3",
    "plots=false",
)


def _nan_slope(strategy: dict[str, Any]) -> None:
    strategy["control"].speculation.slope[0] = math.nan


def _agent(edit):
    return lambda strategy: edit(strategy["agent"])


CHECKPOINT_ATTACKS = {
    "a NaN in ASFL's features": (
        ASFL,
        lambda s: s["features"].__setitem__(3, math.nan),
        "features has NaN",
    ),
    "ASFL's features x1e30": (ASFL, lambda s: s["features"].fill_(1e30), "features are not"),
    "an action outside the grid": (ASFL, lambda s: s.update(action=9), "action 9"),
    "a cache model of another length": (
        ASFL,
        lambda s: setattr(next(iter(s["cache"].values())), "vector", torch.zeros(3)),
        "cache models",
    ),
    "log_alpha = 100 in the agent": (
        ASFL,
        _agent(lambda a: a["log_alpha"].fill_(100.0)),
        "log_alpha",
    ),
    "agent actor weights x1e37": (ASFL, _agent(_scale_actor(1e37)), "beyond"),
    "a NaN FedSU slope": (FEDSU, _nan_slope, "control.speculation.slope has NaN"),
    "a FedSU start tick beyond the clock": (
        FEDSU,
        lambda s: s["control"].speculation.since.fill_(10**6),
        "start ticks",
    ),
}


@pytest.mark.parametrize("attack", list(CHECKPOINT_ATTACKS))
def test_a_crafted_strategy_state_in_a_checkpoint_is_refused(attack, tmp_path: Path) -> None:
    run, edit, named = CHECKPOINT_ATTACKS[attack]
    train_in_process(tmp_path, *run, "rounds=3")
    saved = load_checkpoint(tmp_path / "checkpoint.pt")
    edit(saved["strategy"])
    (tmp_path / "checkpoint.prev.pt").unlink()
    (tmp_path / "checkpoint.pt").unlink()
    save_checkpoint(tmp_path / "checkpoint.pt", saved)
    rows = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError) as err:
        train_in_process(tmp_path, *run, "rounds=4", "resume=true")
    line = str(err.value)
    assert line.startswith("checkpoint: ") and named in line and "\n" not in line, line
    assert (tmp_path / "metrics.jsonl").read_bytes() == rows  # nothing lost, nothing added


def test_fl_run_refuses_a_nan_fedsu_slope_with_one_line_and_a_failure(tmp_path: Path) -> None:
    """Before: every reply was rejected (the digests never matched) and the run exited 0."""
    train_in_process(tmp_path, *FEDSU, "rounds=3")
    assert all(r["rejected"] == 0 for r in read_metrics(tmp_path))
    saved = load_checkpoint(tmp_path / "checkpoint.pt")
    _nan_slope(saved["strategy"])
    (tmp_path / "checkpoint.prev.pt").unlink()
    save_checkpoint(tmp_path / "checkpoint.pt", saved)
    (tmp_path / "checkpoint.prev.pt").unlink()
    proc = python_run(fl_run_cmd(f"hydra.run.dir={tmp_path}", *FEDSU, "rounds=5", "resume=true"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert "fl-run: checkpoint: " in out and "slope has NaN" in out
    assert len(read_metrics(tmp_path)) == 3
