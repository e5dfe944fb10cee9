"""Population scale on one machine: lazy clients, compact node states, exact resume.

A client's data depends on (seed, client id) alone; the local engine builds a node's
Context only for a message to it and keeps only non-empty states, in memory or spilled
to SQLite, restored exactly by a resume. Counts, not timings, show that the cost follows
the clients that train rather than the population.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
from conftest import read_metrics, train_in_process, without_wall_time
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fl.common.config import compose, to_run_config
from fl.run.checkpoint import load_checkpoint, save_checkpoint
from fl.run.engines.local import LocalGrid
from fl.run.engines.node_states import NodeStateError, NodeStates
from fl.run.loops import LoopSettings, RoundDriver
from fl.world.data import SyntheticDevices
from fl.world.population import NodeIds, PartitionMap, member
from fl.world.task import get_task

SMALL_TASK = ["task=synthetic", "partition=natural", "task.options.dim=8", "task.hidden=[8]"]
# APF keeps a synced copy of the model and mask on each client it trained (Context.state).
APF = ["strategy=apf", "strategy.ema_alpha=0.5", "strategy.threshold=0.3", "local_epochs=1"]


def _run(out, clients: int, per_round: int, rounds: int, *extra: str, **grid_options):
    overrides = [
        *SMALL_TASK,
        f"num_clients={clients}",
        f"clients_per_round={per_round}",
        f"rounds={rounds}",
        *extra,
    ]
    grid = partial(LocalGrid, announces_partitions=True, **grid_options)
    return train_in_process(out, *overrides, grid_class=grid)


def test_a_client_gets_the_same_data_whatever_the_population_and_order():
    small, huge = SyntheticDevices(3, 50), SyntheticDevices(3, 2_000_000)
    assert np.array_equal(small.train_sizes, huge.train_sizes[:50])
    huge.train(41)  # another client first: no effect on client 7
    for a, b in zip(small.train(7), huge.train(7), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(small.train(7)[0][:5], small.train(8)[0][:5])
    # the eager dataset holds the same clients, device by device
    eager = small.dataset()
    assert eager.groups is not None
    assert torch.equal(eager.x_train[eager.groups == 7], small.train(7)[0])
    # through a run's task: the same client of a 50- and of a 1,000,000-client run
    tasks = [get_task(compose([*SMALL_TASK, f"num_clients={n}"])) for n in (50, 1_000_000)]
    assert all(t.partitions is None for t in tasks)  # nothing built per client up front
    assert len(tasks[1].sizes) == 1_000_000
    for a, b in zip(tasks[0].client_data(13), tasks[1].client_data(13), strict=True):
        assert torch.equal(a, b)
    assert len(tasks[1].dataset.y_train) == 0  # clients' data is generated when asked


def test_partition_map_holds_a_population_as_arrays():
    ids = np.array([40, 10, 30, 20], dtype=np.int64)  # partition p -> node ids[p]
    nodes = PartitionMap(ids)
    assert dict(nodes) == {10: 1, 20: 3, 30: 2, 40: 0} and list(nodes) == [10, 20, 30, 40]
    assert list(nodes.by_partition) == [40, 10, 30, 20]
    assert 25 not in nodes and 2**70 not in nodes and nodes.get(99) is None
    with pytest.raises(ValueError, match="several partitions"):
        PartitionMap(np.array([5, 5]))
    assert nodes.by_partition.partitions.tolist() == [0, 1, 2, 3]
    assert list(nodes.by_partition.without({10, 30, 7})) == [40, 20]
    assert nodes.by_partition.without({10, 30, 7}).partitions.tolist() == [0, 3]
    values = np.array([1, 5, 9, 2**64 - 1], dtype=np.uint64)
    assert member(values, np.array([9, 1, 2**64 - 1], dtype=np.uint64)).tolist() == [
        True, False, True, True
    ]  # fmt: skip
    assert not member(values, np.zeros(0, dtype=np.uint64)).any()


def test_member_agrees_with_a_set_whatever_the_ids_low_bits():
    rng = np.random.default_rng(5)
    for trial in range(300):
        if trial % 2:
            pool = rng.integers(0, 2**64 - 1, size=400, dtype=np.uint64)  # random, as Flower's
        else:
            pool = np.arange(400, dtype=np.uint64) * 4096  # one low-bit slot for all
        values = rng.choice(pool, int(rng.integers(0, 300)))
        of = rng.choice(pool, int(rng.integers(0, 50)), replace=False)
        assert member(values, of).tolist() == [v in set(of.tolist()) for v in values.tolist()]


def test_the_loop_finds_idle_nodes_in_a_population_without_walking_it():
    """A million nodes, two in flight: `idle` filters them with array operations, and for
    groups keeps exactly the nodes of the groups none of whose members is in flight."""
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(1, 10**6 + 1, dtype=np.uint64) * 7919)  # partition -> node
    partitions = PartitionMap(ids)
    in_flight = {int(ids[3]): None, int(ids[9]): None}  # partitions 3 and 9: groups 3 and 1
    for kind, expected in (
        ("semi_async", [p for p in range(10**6) if p not in (3, 9)]),
        ("groups", [p for p in range(10**6) if p % 4 in (0, 2)]),
    ):
        driver = RoundDriver(LoopSettings(kind=kind, groups=4), None, partitions, math.inf)
        driver.flights = in_flight  # type: ignore[assignment]
        idle = driver.idle(partitions.by_partition)
        assert isinstance(idle, NodeIds) and np.array_equal(idle.ids, ids[expected])


def test_contexts_are_built_only_for_the_nodes_that_train(tmp_path):
    """200,000 clients, 6 a round: the engine builds one Context per message and keeps
    the states of the clients that trained, never one object per node of the population."""
    rows, grid = _run(tmp_path, 200_000, 6, 2, *APF)
    assert [r["replies"] for r in rows] == [6, 6]
    # 12 train messages (no partition queries), one Context each, never two alive at once
    # (workers=1); APF's synced copies kept for the 12 clients that trained
    assert (grid.built, grid.peak_live, len(grid.states)) == (12, 1, 12)


def test_node_states_round_trip_exactly_in_memory_and_in_sqlite(tmp_path):
    state = RecordDict(
        {
            "copy": ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3))}),
            "meta": ConfigRecord({"version": 3, "mask": b"\x01\x00", "name": "x"}),
        }
    )
    memory, spilled = NodeStates(), NodeStates(tmp_path, memory_bytes=0)
    for store in (memory, spilled):
        store.put(2**61, state)
        store.put(5, RecordDict())  # empty: nothing kept
        assert list(store) == [2**61] and len(store) == 1
        back = store.get_state(2**61)
        assert np.array_equal(back["copy"]["w"].numpy(), state["copy"]["w"].numpy())
        assert dict(back["meta"]) == dict(state["meta"])
        assert len(store.get_state(5)) == 0
    assert spilled.spilled and not memory.spilled
    assert not list(tmp_path.glob("node-states-*"))  # open but nameless: a kill leaves nothing
    # what a checkpoint saves: only non-empty states, restored into a fresh grid
    save_checkpoint(tmp_path / "ck.pt", {"nodes": spilled, "rest": 1})
    saved = load_checkpoint(tmp_path / "ck.pt", required=("nodes",))["nodes"]
    spilled.close()
    assert not list(tmp_path.glob("node-states-*.sqlite"))
    grid = LocalGrid(lambda m, c: m, 3, {})
    node = grid.nodes.by_partition[1]
    grid.load_state_dict({node: saved[2**61]})
    assert dict(grid.context(node).state["meta"]) == dict(state["meta"])
    assert len(grid.context(grid.nodes.by_partition[0]).state) == 0
    with pytest.raises(ValueError, match="not in this grid"):
        grid.load_state_dict({7: state})


def test_resume_with_states_spilled_to_sqlite_matches_an_uninterrupted_run(tmp_path):
    """APF's clients keep synced copies: a resumed run (states through SQLite and the
    checkpoint) must send and receive exactly what an uninterrupted one does."""
    full, grid = _run(tmp_path / "full", 12, 5, 4, *APF)
    assert len(grid.states) > 5 and not grid.states.spilled
    _run(tmp_path / "cut", 12, 5, 2, *APF, spill_dir=tmp_path, state_memory_bytes=0)
    resumed, grid = _run(
        tmp_path / "cut", 12, 5, 4, *APF, "resume=true", spill_dir=tmp_path, state_memory_bytes=0
    )
    assert grid.states.spilled
    assert [r["round"] for r in resumed] == [1, 2, 3, 4]
    assert without_wall_time(resumed) == without_wall_time(full)


def test_a_context_is_what_a_supernode_would_hold():
    seen: list[tuple[int, int]] = []

    def app(msg: Message, context: Context) -> Message:
        seen.append((context.node_config["partition-id"], context.node_config["num-partitions"]))
        return Message(RecordDict(), reply_to=msg)

    grid = LocalGrid(app, 50_000, {"k": "v"}, seed=2)
    node = grid.nodes.by_partition[49_999]
    context = grid.context(node)
    assert (context.node_id, context.run_config) == (node, {"k": "v"})
    (reply,) = grid.send_and_receive([Message(RecordDict(), node, "query.x")])
    assert reply.metadata.src_node_id == node and seen == [(49_999, 50_000)]
    assert (grid.built, grid.live) == (1, 0)
    assert grid.partition_map() is None  # this app does not announce its node config


def test_a_spilled_state_that_does_not_decode_is_one_clear_error(tmp_path):
    states = NodeStates(tmp_path, memory_bytes=0)
    states.put(7, RecordDict({"meta": ConfigRecord({"version": 3})}))
    assert states.spilled
    states._db.execute("UPDATE states SET state = ? WHERE node = 7", (b"\xff\x00garbage",))
    with pytest.raises(NodeStateError, match="the saved state of node 7 does not decode"):
        states.get_state(7)
    states.close()


def test_a_spill_file_that_lost_its_table_is_one_clear_error(tmp_path):
    states = NodeStates(tmp_path, memory_bytes=0)
    states.put(7, RecordDict({"meta": ConfigRecord({"version": 3})}))
    states._db.execute("DROP TABLE states")
    with pytest.raises(NodeStateError, match="the spilled node states cannot be used"):
        states.get_state(7)
    with pytest.raises(NodeStateError):
        states.put(8, RecordDict({"meta": ConfigRecord({"version": 1})}))
    states.close()


@pytest.mark.parametrize(("per_round", "built_first"), [(30, 30), (10, 0)])
def test_a_run_that_trains_every_client_builds_them_before_round_one(
    tmp_path, monkeypatch, per_round, built_first
):
    """Full participation: the local engine builds the generated population before round 1
    (a loaded dataset is built before training too), into the task the clients read; the
    run's numbers are those of clients built when first asked. A sampled run builds none."""
    from fl.run.engines import local
    from fl.world.task import Task

    built: list[int] = []
    lazy = Task.build_clients

    def recorded(task: Task) -> int:
        built.append(lazy(task))
        return built[-1]

    def run(folder: str) -> list[dict[str, object]]:
        overrides = [*SMALL_TASK, "num_clients=30", f"clients_per_round={per_round}", "rounds=2"]
        cfg = compose([*overrides, f"output_dir={tmp_path / folder}", "progress=false"])
        local.run_local(cfg, to_run_config(cfg))
        return without_wall_time(read_metrics(tmp_path / folder))

    monkeypatch.setattr(Task, "build_clients", recorded)
    before = run("built")
    assert built == ([built_first] if built_first else [])
    task = get_task(compose([*SMALL_TASK, "num_clients=30"]))
    assert len(task._generated) == 30 or not built_first
    monkeypatch.setattr(Task, "build_clients", lambda task: 0)  # as before: when asked
    assert run("lazy") == before
