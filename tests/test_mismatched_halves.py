"""Halves of two strategies in one run: the server half names itself, a round of refusals
stops the run in one line under any loop, and a client names the likely mismatch."""

from __future__ import annotations

import re

import pytest
from conftest import REPO
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.serverapp.strategy import FedAvg

from clients.app import app as client_app
from fl.common.config import compose, to_run_config
from fl.run.engines.local import LocalGrid
from fl.strategy.registry import get_strategy
from fl.wire.contract import CONTRACT_MISMATCH, ContractMismatch, mismatch_reply, stamp
from fl.world.task import get_task

NODES = 4
SMALL = [f"num_clients={NODES}", f"clients_per_round={NODES}", "local_steps=2"]
LINE = (
    "contract mismatch: the server sends strategy=apf (contract 1), this ClientApp runs "
    "strategy=fedavg (contract 1); the run is stopped"
)


def _grid(strategy: str) -> LocalGrid:
    """Our ClientApp on NODES nodes, running `strategy`'s client half."""
    cfg = compose([*SMALL, f"strategy={strategy}"])
    return LocalGrid(client_app, NODES, to_run_config(cfg))


def _apf_server():
    spec = get_strategy("apf")
    server = spec.server(spec.make_params({"threshold": 0.5}), seed=0, clients_per_round=NODES)
    server.fraction_evaluate = 0.0
    return server


def _initial() -> ArrayRecord:
    return ArrayRecord(get_task(compose(SMALL)).new_model().state_dict())


def test_the_server_half_stamps_its_own_name_whoever_calls_it():
    grid = _grid("apf")
    for name, params in (("apf", {}), ("fedprox", {"mu": 0.1}), ("flower", {})):
        spec = get_strategy(name)
        server = spec.server(spec.make_params(params), seed=0, clients_per_round=2)
        # a caller's own stamp for another strategy does not override the half's
        config = ConfigRecord(stamp("fedavg"))
        messages = list(server.configure_train(1, _initial(), config, grid))
        assert len(messages) == 2
        for message in messages:
            keys = message.content.config_records["config"]
            assert (keys["fl-strategy"], keys["fl-contract"]) == (name, 1)


def test_apf_server_in_flowers_loop_with_a_fedavg_clientapp_stops_in_round_1():
    # The run: APF's server half in Flower's Strategy.start, our ClientApp on FedAvg.
    # It used to train in odd rounds, fail in even ones (a misleading CodecError) and end.
    server = _apf_server()
    with pytest.raises(ContractMismatch) as err:
        server.start(grid=_grid("fedavg"), initial_arrays=_initial(), num_rounds=4)
    message = str(err.value)
    assert message.endswith(LINE) and "\n" not in message
    assert server.stats.failed == NODES and server.stats.accepted == 0
    assert server.sync is not None and server.sync.current == 1  # round 1 only


def test_the_hand_written_example_app_stops_on_a_clientapp_of_another_strategy(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from examples.apf_app import app

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ContractMismatch, match=re.escape(LINE)):
        app.serverapp(_grid("fedavg"), context)


def test_a_round_with_some_refusals_goes_on_and_counts_them():
    server = _apf_server()
    grid = _grid("apf")
    messages = list(server.configure_train(1, _initial(), ConfigRecord(), grid))
    replies = sorted(grid.send_and_receive(messages), key=lambda r: r.metadata.src_node_id)
    stray = messages[0]
    refusal = mismatch_reply(stray, stray.content.config_records["config"], "pas")
    assert refusal is not None and refusal.error.code == CONTRACT_MISMATCH
    arrays, _ = server.aggregate_train(1, [refusal, *replies[1:]])
    assert arrays is not None
    assert (server.stats.failed, server.stats.accepted) == (1, NODES - 1)


def test_a_round_of_refusals_alone_stops_the_run():
    server = _apf_server()
    grid = _grid("apf")
    messages = list(server.configure_train(1, _initial(), ConfigRecord(), grid))
    refusals = [mismatch_reply(m, m.content.config_records["config"], "pas") for m in messages]
    with pytest.raises(ContractMismatch, match="this ClientApp runs strategy=pas"):
        server.aggregate_train(1, refusals)


def _unstamped_round_2_reason() -> str:
    """The error a FedAvg ClientApp replies to APF's round-2 instruction without the stamp
    (a server half built outside the registry, or from before the stamp)."""
    server = _apf_server()
    server.strategy_name = None
    grid = _grid("fedavg")
    arrays = _initial()
    for rnd in (1, 2):
        replies = list(
            grid.send_and_receive(server.configure_train(rnd, arrays, ConfigRecord(), grid))
        )
        new, _ = server.aggregate_train(rnd, replies)
        arrays = new if new is not None else arrays
    assert all(r.has_error() for r in replies)
    return replies[0].error.reason


def test_a_clientapp_names_the_likely_mismatch_when_it_cannot_read_a_payload():
    reason = _unstamped_round_2_reason()
    assert reason.startswith("CodecError: masked payload needs the receiver's base vector: ")
    assert "the server sent a 'masked' payload with synced client state" in reason
    assert "this ClientApp's half of strategy=fedavg cannot read" in reason
    assert "run both halves with the same strategy" in reason
    assert "\n" not in reason


def test_a_stock_flower_server_to_an_apf_clientapp_names_the_mismatch_too():
    flower = FedAvg(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES)
    grid = _grid("apf")
    replies = list(
        grid.send_and_receive(flower.configure_train(1, _initial(), ConfigRecord(), grid))
    )
    assert all(r.has_error() for r in replies)
    reason = replies[0].error.reason
    assert "message has no 'sync' record: the server sent a 'dense' payload" in reason
    assert "strategy=apf cannot read" in reason and "same strategy" in reason
