"""The cluster client: per-rank shares of the trainer's global batches, the share
controller, and real gloo ranks on loopback that reproduce the full-batch gradient."""

from __future__ import annotations

import functools
import itertools
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fl_env, train_in_process
from flwr.app import Context

from clients.cluster import app as cluster_app
from clients.cluster_check import cluster_check
from clients.ranks import ClusterConfig, RankBatchSampler, ShareController
from clients.trainer import TrainSettings, _batches
from fl.run.engines.local import LocalGrid
from fl.strategy.client import ClientHooks


def _union_of_ranks(n: int, settings: TrainSettings, shares: list[int]) -> list[list[int]]:
    """Each step's batch, rebuilt from every rank's sampler with fixed shares."""
    world = len(shares)

    def schedule(step: int, remaining: int) -> tuple[int, list[int]]:
        size = min(sum(shares), remaining)
        cut = shares if size == sum(shares) else [size] + [0] * (world - 1)
        return sum(shares), cut

    per_rank = [list(RankBatchSampler(n, settings, r, schedule)) for r in range(world)]
    return [list(itertools.chain(*parts)) for parts in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("steps, epochs", [(7, 0), (0, 2)])
def test_rank_shares_rebuild_the_trainers_global_batches(steps, epochs):
    settings = TrainSettings(steps, epochs, batch_size=24, lr=0.1, seed=5)
    expected = [
        b.tolist()
        for b in _batches(100, torch.Generator().manual_seed(5), settings, ClientHooks(None))
    ]
    assert _union_of_ranks(100, settings, [15, 6, 3]) == expected
    assert len(expected) == (7 if steps else 2 * 5)  # 5 batches per epoch: 4 of 24, 1 of 4


def test_cpu_controller_moves_shares_towards_speed_and_keeps_the_batch():
    controller = ShareController(ClusterConfig(3, predictor="last"))
    speeds = [100.0, 300.0, 600.0]  # samples/s
    shares = controller.shares(100)
    assert shares == [34, 33, 33]  # nothing measured: BSP
    for _ in range(3):
        controller.observe(shares, [b / v for b, v in zip(shares, speeds, strict=True)])
        shares = controller.shares(100)
        assert sum(shares) == 100
    assert shares == [10, 30, 60]
    assert controller.shares(2) in ([1, 1, 0], [0, 1, 1], [1, 0, 1])  # fewer samples than ranks


def test_cluster_config_from_the_node_config_names_bad_values():
    assert ClusterConfig.from_node_config({"partition-id": 0}) is None
    config = ClusterConfig.from_node_config(
        {"cluster-ranks": 2, "cluster-slowdown": "1,3", "cluster-backend": "gloo"}
    )
    assert config == ClusterConfig(2, "gloo", slowdown=(1.0, 3.0))
    for bad, match in [
        ({"cluster-ranks": "two"}, "cluster-ranks"),
        ({"cluster-ranks": 2, "cluster-slowdown": "1"}, "cluster-slowdown"),
        ({"cluster-ranks": 2, "cluster-controller": "tpu"}, "cluster-controller"),
        ({"cluster-ranks": 2, "cluster-backend": "nccl", "cluster-device": "cpu"}, "nccl"),
        ({"cluster-ranks": 2, "cluster-caps": "4,x"}, "cluster-caps"),
    ]:
        with pytest.raises(ValueError, match=match):
            ClusterConfig.from_node_config(bad)


def test_two_gloo_ranks_on_loopback_give_the_full_batch_gradient():
    result = cluster_check(ranks=2, backend="gloo", device="cpu", steps=4, batch=96)
    assert result["shares"] == [64, 32]  # unequal shares (forced by the per-rank caps)
    assert result["steps"] == 4
    assert result["grad_norm"] > 0.01
    assert result["grad_max_abs_diff"] <= 1e-6  # vs one process on the 96 samples
    assert result["weights_max_abs_diff"] <= 1e-6  # after 4 SGD steps


def _run_args(*extra: str) -> tuple[str, ...]:
    return (
        "strategy=lbbsp",
        "num_clients=2",
        "clients_per_round=2",
        "rounds=2",
        "local_steps=3",
        "batch_size=32",
        "partition=iid",
        "system=heterogeneous",
        "system.speed_spread=4",
        "system.bandwidth_spread=1",
        "progress=false",
        *extra,
    )


class _ClusterGrid(LocalGrid):
    """A LocalGrid of the cluster ClientApp whose partition-0 node is a cluster."""

    def __init__(
        self, client_app: Any, num_nodes: int, run_config: dict[str, Any], cluster: dict[str, Any]
    ) -> None:
        super().__init__(cluster_app, num_nodes, run_config)
        self.cluster = cluster

    def context(self, node_id: int) -> Context:
        context = super().context(node_id)
        if context.node_config["partition-id"] == 0:
            context.node_config.update(self.cluster)
        return context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_cluster_clientapp_trains_as_one_process_would(tmp_path: Path):
    """Ranks started by rank 0 (2, one emulated 3x slower), then 3 ranks of workers
    started once by the documented command serving both rounds: each run's metrics are
    a one-process client's."""
    plain, _ = train_in_process(tmp_path / "plain", *_run_args())
    spawned = functools.partial(
        _ClusterGrid, cluster={"cluster-ranks": 2, "cluster-slowdown": "1,3"}
    )
    runs = {"spawned": train_in_process(tmp_path / "spawned", *_run_args(), grid_class=spawned)[0]}
    master = f"127.0.0.1:{_free_port()}"
    command = ["workers", "--master", master, "--ranks", "3"]
    workers = subprocess.Popen([sys.executable, "-m", "clients.cluster", *command], env=fl_env())
    try:
        external = functools.partial(
            _ClusterGrid, cluster={"cluster-ranks": 3, "cluster-master": master}
        )
        runs["external"] = train_in_process(tmp_path / "ext", *_run_args(), grid_class=external)[0]
        assert workers.poll() is None  # still serving after two rounds
    finally:
        workers.terminate()
        workers.wait(timeout=30)
    for rows in runs.values():
        assert [r["replies"] for r in rows] == [2, 2]  # the cluster node replied each round
        for a, b in zip(plain, rows, strict=True):
            assert b["accuracy"] == pytest.approx(a["accuracy"], abs=1e-9)
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["batch_total"] == a["batch_total"]


def test_gpu_check_runs_nccl_on_cuda_or_says_why_it_skipped():
    from clients.cluster_check import gpu_cluster_check

    result = gpu_cluster_check()
    if not torch.cuda.is_available():
        assert result == {"skipped": "no CUDA device: the NCCL cluster-client check needs a GPU"}
        return
    checks = [result[k] for k in ("nccl", "gloo_cuda") if k in result and "ranks" in result[k]]
    assert checks, result
    for check in checks:
        assert check["grad_max_abs_diff"] <= 1e-6 and check["weights_max_abs_diff"] <= 1e-6


class _FirstCollective(Exception):
    """Raised by the recorded first collective: the order up to it is all the test needs."""


def _record_binding(monkeypatch: pytest.MonkeyPatch, gpus: int) -> list[tuple[Any, ...]]:
    """A node of `gpus` GPUs as torch.distributed sees it, with each call recorded."""
    import torch.distributed as dist

    events: list[tuple[Any, ...]] = []

    def init(backend: str, **kwargs: Any) -> None:
        events.append(("init", backend, kwargs["rank"], kwargs.get("device_id")))

    def first_collective(objects: list[Any], src: int) -> None:
        events.append(("broadcast_object_list", torch.cuda.current_device()))
        raise _FirstCollective

    current = [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    def set_device(device: torch.device) -> None:
        current[0] = torch.device(device).index
        events.append(("set_device", torch.device(device)))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "broadcast_object_list", first_collective)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    return events


def test_the_device_map_puts_rank_r_on_gpu_r_mod_the_gpu_count(monkeypatch):
    from clients.ranks import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [rank_device("cuda", r) for r in range(4)] == [
        torch.device("cuda", i) for i in (0, 1, 0, 1)
    ]
    assert rank_device("cpu", 3) == torch.device("cpu")


@pytest.mark.parametrize("backend, device", [("nccl", "cuda"), ("gloo", "cpu")])
def test_every_rank_binds_its_device_before_the_first_collective(monkeypatch, backend, device):
    """On a node of 2 GPUs each rank makes its GPU current and hands it to the group as its
    `device_id` before the first collective; on CPU nothing is bound. Without that, NCCL
    ranks would all build their communicators on cuda:0."""
    from clients.ranks import ROUND_KEY, Instruction, run_cluster_round, worker_main

    events = _record_binding(monkeypatch, gpus=2)
    port = _free_port()
    config = ClusterConfig(2, backend, device=device, master=f"127.0.0.1:{port}")
    instruction = Instruction({}, 0, {}, (), device)
    data = (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(_FirstCollective):  # rank 0 opens the round at `port`
        run_cluster_round(config, torch.nn.Linear(3, 2), data, instruction, ClientHooks(None))
    rank0, events[:] = list(events), []
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    store.set(ROUND_KEY, "round-1")
    with pytest.raises(_FirstCollective):
        worker_main("127.0.0.1", store.port, 1, 2, backend, 1, device)
    for rank, seen in enumerate((rank0, events)):
        if device == "cuda":
            gpu = torch.device("cuda", rank)
            assert seen == [
                ("set_device", gpu),
                ("init", backend, rank, gpu),
                ("broadcast_object_list", rank),
            ]
        else:
            assert seen == [("init", backend, rank, None), ("broadcast_object_list", 0)]


def test_a_worker_started_for_another_device_names_the_mismatch(monkeypatch):
    from clients import ranks

    events = _record_binding(monkeypatch, gpus=0)
    instruction = ranks.Instruction({}, 0, {}, (), "cuda")

    def deliver(objects: list[Any], src: int) -> None:
        objects[0] = instruction

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", deliver)
    with pytest.raises(ValueError, match=r"started with --device cpu.*trains on cuda"):
        ranks._serve_round(1, "cpu")
    assert events == []


def test_the_gpu_check_runs_nccl_ranks_on_every_gpu_when_there_are_two(monkeypatch):
    from clients import cluster_check as check

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 0))
    monkeypatch.setattr(check, "cluster_check", lambda *args: calls.append(args) or {})
    check.gpu_cluster_check()
    assert calls == [(2, "nccl", "cuda")]
