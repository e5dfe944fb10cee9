"""A process keeps one run's task and client setup: a Hydra multirun's jobs share a process
(the basic launcher, a joblib worker), and each job used to keep its own ~165 MB of room
data, up to four tasks and every setup, until joblib retired the worker."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
from flwr.app import Context, RecordDict

from clients.app import _setup_of
from fl.common.config import compose, to_run_config
from fl.common.run_slot import RunSlot
from fl.world.task import get_task

TINY = ["task=synthetic", "partition=natural", "task.options.dim=8", "task.hidden=[8]"]


class _Data:
    """Something a run made (weak-referenceable)."""


def test_a_runs_value_is_let_go_before_the_next_runs_is_made():
    slot: RunSlot[_Data] = RunSlot()
    made: list[str] = []

    def make(key: str) -> _Data:
        made.append(key)
        return _Data()

    first = weakref.ref(slot.get("run-a", lambda: make("run-a")))
    assert slot.get("run-a", lambda: make("run-b")) is first()  # the same run: kept
    alive_while_making = []

    def second() -> _Data:
        alive_while_making.append(first() is not None)
        return make("run-b")

    slot.get("run-b", second)
    assert alive_while_making == [False]  # gone before the next one was made
    assert made == ["run-a", "run-b"]


def test_a_failed_make_leaves_the_slot_empty_and_the_next_call_makes_again():
    slot: RunSlot[_Data] = RunSlot()

    def fail() -> _Data:
        raise ValueError("bad run")

    with pytest.raises(ValueError, match="bad run"):
        slot.get("run-a", fail)
    assert isinstance(slot.get("run-a", _Data), _Data)


def test_threads_asking_at_once_share_one_value_made_once():
    slot: RunSlot[_Data] = RunSlot()
    made = []
    gate = threading.Barrier(8)

    def make() -> _Data:
        made.append(1)
        time.sleep(0.05)  # a slow build: the other threads ask meanwhile
        return _Data()

    def ask() -> _Data:
        gate.wait()
        return slot.get("run-a", make)

    with ThreadPoolExecutor(8) as pool:
        values = list(pool.map(lambda _: ask(), range(8)))
    assert len(made) == 1 and all(v is values[0] for v in values)


def test_a_sweeps_next_job_frees_the_last_jobs_task_and_client_setup():
    jobs = [compose([*TINY, "num_clients=6", f"seed={seed}"]) for seed in (0, 1)]
    contexts = [
        Context(
            run_id=1,
            node_id=100,
            node_config={"partition-id": 0, "num-partitions": 6},
            state=RecordDict(),
            run_config=to_run_config(cfg),
        )
        for cfg in jobs
    ]
    task = weakref.ref(get_task(jobs[0]))
    setup = weakref.ref(_setup_of(contexts[0]))
    assert get_task(jobs[0]) is task() and _setup_of(contexts[0]) is setup()  # a run's own
    assert setup().task is task()

    get_task(jobs[1])
    _setup_of(contexts[1])
    gc.collect()
    assert task() is None and setup() is None  # the last job's data is gone
