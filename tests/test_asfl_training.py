"""ASFL's training protocol (spec §1.6): the SAC agent saved and loaded whole or as a policy,
files checked as untrusted, `policy=trained` acting greedily, `agent_file` carrying the
agent from run to run, and both resuming exactly."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, train_in_process, without_wall_time

from fl.common.config import ConfigError, compose
from fl.mechanisms.sac import AgentFileError, GreedyPolicy, SACConfig, SACDiscrete
from fl.run.validation import validate

sys.path.insert(0, str(REPO / "experiments"))
import asfl_train  # (experiments/ is not a package)

CONFIG = SACConfig(state_dim=3, num_actions=4, batch_size=4, buffer_size=50)


def _trained(seed: int = 1) -> SACDiscrete:
    agent = SACDiscrete(CONFIG, seed=seed)
    for i in range(8):
        state = torch.full((3,), i / 8)
        agent.remember(state, agent.act(state), 0.1 * i, torch.ones(3), done=i == 7)
        agent.update()
    return agent


def test_an_agent_file_holds_the_whole_agent(tmp_path: Path) -> None:
    agent = _trained()
    agent.save(tmp_path / "agent.pt", {"actions": [[0.5, 3]]})
    copy = SACDiscrete(CONFIG, seed=9)
    copy.load(tmp_path / "agent.pt", {"actions": [[0.5, 3]]})
    assert copy.buffer.size == 8 and copy.buffer.dones[:8].tolist() == [0.0] * 7 + [1.0]
    states = [torch.rand(3, generator=torch.Generator().manual_seed(i)) for i in range(10)]
    assert [agent.act(s) for s in states] == [copy.act(s) for s in states]
    assert agent.update() == copy.update()  # optimisers, buffer, generator: all carried on


def test_a_policy_file_acts_greedily_without_learning(tmp_path: Path) -> None:
    agent = _trained()
    agent.save_policy(tmp_path / "policy.pt")
    agent.save(tmp_path / "agent.pt")
    for path in ("policy.pt", "agent.pt"):  # the actor of either file
        policy = GreedyPolicy.load(tmp_path / path, CONFIG)
        for i in range(10):
            state = torch.rand(3, generator=torch.Generator().manual_seed(i))
            with torch.no_grad():
                probs, _ = agent.policy(state.unsqueeze(0))
            assert policy.act(state) == int(probs.argmax())


def _tamper(path: Path, edit: Any) -> None:
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, path)


class _Code:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getcwd, ())  # a pickle that runs code when loaded


BAD = {
    "a directory": lambda p: (p.unlink(), p.mkdir()),
    "a FIFO": lambda p: (p.unlink(), os.mkfifo(p)),
    "a pickle with code": lambda p: torch.save({"kind": _Code()}, p),
    "another kind": lambda p: _tamper(p, lambda d: d.update(kind="checkpoint")),
    "other sizes": lambda p: _tamper(p, lambda d: d["sizes"].update(hidden=32)),
    "another action grid": lambda p: _tamper(p, lambda d: d.update(meta={"actions": [[1, 1]]})),
    "a weight of another shape": lambda p: _tamper(
        p, lambda d: d["body"]["actor"].update({"0.weight": torch.zeros(64, 4)})
    ),
    "a NaN weight": lambda p: _tamper(
        p, lambda d: d["body"]["critics"]["0.0.weight"].fill_(float("nan"))
    ),
    "an action out of range": lambda p: _tamper(
        p, lambda d: d["body"]["buffer"]["actions"].fill_(7)
    ),
    "a moment of another shape": lambda p: _tamper(
        p, lambda d: d["body"]["actor_optimizer"]["state"][0].update(exp_avg=torch.zeros(2))
    ),
    "a buffer beyond its capacity": lambda p: _tamper(
        p, lambda d: d["body"]["buffer"].update(actions=torch.zeros(60, dtype=torch.int64))
    ),
}


# faults outside the actor: a policy loads from such a file, an agent does not
BESIDE_THE_ACTOR = {
    "a NaN weight",
    "an action out of range",
    "a moment of another shape",
    "a buffer beyond its capacity",
}


@pytest.mark.parametrize("fault", sorted(BAD))
def test_an_untrusted_file_is_refused_in_one_line(fault: str, tmp_path: Path) -> None:
    path = tmp_path / "agent.pt"
    _trained().save(path)
    BAD[fault](path)
    loads = [lambda: SACDiscrete(CONFIG, 0).load(path)]
    if fault in BESIDE_THE_ACTOR:
        GreedyPolicy.load(path, CONFIG)
    else:
        loads.append(lambda: GreedyPolicy.load(path, CONFIG))
    for load in loads:
        with pytest.raises(AgentFileError) as err:
            load()
        assert str(err.value).startswith(f"agent file {path}:") and "\n" not in str(err.value)


RUN = (
    "strategy=asfl",
    "system=heterogeneous",
    "clients_per_round=6",
    "num_clients=10",
    "local_epochs=1",
    "strategy.batch_size=4",
    "strategy.quotas=[0.2,0.5]",
    "strategy.lags=[1,2]",
    "strategy.fixed_quota=0.5",
    "strategy.fixed_lag=2",
    "strategy.resync=true",
    "strategy.cfcfm=true",
    "strategy.horizon=4",
    "rounds=4",
    "progress=false",
    "plots=false",
)


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose([*RUN, *overrides]))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_the_config_refuses_a_missing_or_unusable_file_before_the_run(tmp_path: Path) -> None:
    assert "policy_file" in _refused("strategy.policy=trained")
    assert "cannot be read" in _refused(
        "strategy.policy=trained", f"strategy.policy_file={tmp_path}/none.pt"
    )
    assert "is a directory" in _refused(
        "strategy.policy=trained", f"strategy.policy_file={tmp_path}"
    )
    assert "policy=sac" in _refused("strategy.policy=fixed", f"strategy.agent_file={tmp_path}/a")
    assert "directory does not exist" in _refused(f"strategy.agent_file={tmp_path}/no/a.pt")
    other = SACDiscrete(SACConfig(state_dim=10, num_actions=4, hidden=8), 0)
    other.save_policy(tmp_path / "small.pt", {"actions": [[0.2, 1], [0.2, 2], [0.5, 1], [0.5, 2]]})
    assert "saved for" in _refused(
        "strategy.policy=trained", f"strategy.policy_file={tmp_path}/small.pt"
    )


def _meta() -> dict[str, Any]:
    return {"actions": [[0.2, 1], [0.2, 2], [0.5, 1], [0.5, 2]]}


def _agent(path: Path) -> SACDiscrete:
    agent = SACDiscrete(SACConfig(10, 4, batch_size=4), 0)
    agent.load(path, _meta())
    return agent


@pytest.mark.slow  # seven short runs in process (~20 s)
def test_an_agent_file_carries_the_agent_from_run_to_run_and_resumes(tmp_path: Path):
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    train_in_process(tmp_path / "e1", *RUN, f"strategy.agent_file={first}", "seed=1")
    assert _agent(first).buffer.size == 4
    second.write_bytes(first.read_bytes())
    rows, _ = train_in_process(tmp_path / "e2", *RUN, f"strategy.agent_file={first}", "seed=2")
    carried = _agent(first)
    assert carried.buffer.size == 8 and carried.buffer.dones[:8].sum() == 2  # two episodes
    # the same episode killed after round 2 and resumed: same rows, same agent saved
    killed = (*RUN, f"strategy.agent_file={second}", "seed=2")
    train_in_process(tmp_path / "k", *killed, "rounds=2")
    resumed, _ = train_in_process(tmp_path / "k", *killed, "resume=true")
    assert without_wall_time(resumed) == without_wall_time(rows)
    assert _agent(second).state_dict().keys() == carried.state_dict().keys()
    assert torch.equal(_agent(second).actor[0].weight, carried.actor[0].weight)
    assert torch.equal(_agent(second).buffer.states, carried.buffer.states)


@pytest.mark.slow  # three short runs in process (~10 s)
def test_a_trained_policy_acts_greedily_and_resumes(tmp_path: Path) -> None:
    _trained_agent = SACDiscrete(SACConfig(10, 4), 5)
    _trained_agent.save_policy(tmp_path / "policy.pt", _meta())
    trained = (*RUN, "strategy.policy=trained", f"strategy.policy_file={tmp_path}/policy.pt")
    rows, _ = train_in_process(tmp_path / "t", *trained, "seed=3")
    policy = GreedyPolicy.load(tmp_path / "policy.pt", SACConfig(10, 4), _meta())
    assert rows[0]["action"] == policy.act(torch.zeros(10))  # greedy at the first state
    assert "critic_loss" not in rows[-1]  # it acts, it never learns
    train_in_process(tmp_path / "r", *trained, "seed=3", "rounds=2")
    resumed, _ = train_in_process(tmp_path / "r", *trained, "seed=3", "resume=true")
    assert without_wall_time(resumed) == without_wall_time(rows)


def test_the_verdict_reads_the_paired_intervals() -> None:
    others = {"fedavg": [0.0, 0.1, 0.0], "fedbuff": [0.1, 0.1, 0.2], "safa": [0.0, 0.0, 0.1]}
    assert asfl_train.verdict([0.5, 0.6, 0.55], [0.5, 0.6, 0.56], others) == "reproduces"
    assert asfl_train.verdict([0.5, 0.6, 0.55], [0.7, 0.8, 0.75], others) == "does not reproduce"
    assert asfl_train.verdict([0.1, 0.3, 0.2], [0.1, 0.3, 0.2], others) == "inconclusive"


TINY = [
    "num_clients=12",  # FedBuff's buffer of 10 needs as many in flight
    "clients_per_round=12",
    "task.model=logreg",
    "faults.crash=0.1",
    "system=heterogeneous",
    "rounds=3",
    "progress=false",
    "plots=false",
]


@pytest.mark.slow  # three episodes and one evaluation seed of every arm, tiny (~25 s)
def test_training_continues_after_its_last_episode_and_evaluation_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(asfl_train, "ENV", TINY)
    monkeypatch.setattr(asfl_train, "SPEC_SAC", ["strategy.batch_size=2"])
    monkeypatch.setattr(asfl_train, "GRID", [(0.5, 3), (0.2, 1)])
    asfl_train.train(tmp_path, 2, 0.5)
    asfl_train.train(tmp_path, 3, 0.5)  # a rerun: one more episode, not three
    log = [json.loads(x) for x in (tmp_path / "train-rho0.5.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in log] == [1000, 1001, 1002]
    assert not (tmp_path / "rho0.5" / "002" / "checkpoint.pt").exists()  # tidied
    assert GreedyPolicy.load(tmp_path / "policy-rho0.5.pt", SACConfig(10, 25), _grid())
    report = asfl_train.evaluate(tmp_path, 2, [0.5])
    assert "2 held-out seeds" in report and "verdict: " in report
    arms = {r["arm"] for r in map(json.loads, (tmp_path / "eval.jsonl").read_text().splitlines())}
    assert arms == {"fedavg", "fedbuff", "random", "safa", "fixed-0.2-1", "asfl-rho0.5"}


def _grid() -> dict[str, Any]:
    return {"actions": [[q, t] for q in (0.1, 0.2, 0.3, 0.5, 1.0) for t in (1, 2, 3, 4, 5)]}
