"""The GPU checks of issues 15 and 30 in one script: passes without a GPU, exercises CUDA with one.

- the cluster client on CUDA (`clients.cluster_check.gpu_cluster_check`): NCCL ranks on two or
  more GPUs, else gloo ranks on CUDA tensors plus a one-rank NCCL all-reduce; the
  batch-weighted gradient must equal the full-batch one within 1e-6;
- CUDA tensors on the bulk side channel (`cuda_bulk_check`): a ResNet-18-sized state_dict
  goes through a `BulkGrid` to an in-process node whose ClientApp (behind `bulk_mod`) loads
  it onto the GPU, adds one there and replies; the reply must equal the same computation
  done directly on the GPU, bit for bit, for `grpc` and (where NIXL imports) `rdma`. Where
  NIXL imports it also READs a host blob into a CUDA tensor registered with a NIXL agent;
- cohort training on CUDA (`cohort_check`, issue 30): 1000 synthetic clients (the many-client
  benchmark's workload, MLP 20-32-10, one epoch of batch-16 SGD) trained by the plain loop,
  by the per-client trainer and as one cohort (`clients.cohort`, the stacked cohort moved in
  one transfer) on the same GPU; each arm's seconds, and the cohort's drift from the
  per-client trainer's weights, which must stay within `clients.cohort.DRIFT_TOLERANCE`.

    .venv/bin/python experiments/gpu_check.py --json experiments/out/gpu_check.json

Exit status 0 when every check that could run passed; without CUDA each reports a skip.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.cluster_check import gpu_cluster_check
from clients.cohort import DRIFT_TOLERANCE
from fl.common.files import write_atomic

GRADIENT_TOLERANCE = 1e-6


def _state(size_mb: float, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    count = int(size_mb * 1e6 / 4)
    return {"w": torch.randn(count, generator=gen).to(device), "step": torch.tensor(3).to(device)}


def _gpu_app(device: torch.device) -> ClientApp:
    from fl.net.transport import bulk_mod

    app = ClientApp(mods=[bulk_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        state = {
            k: v.to(device)
            for k, v in msg.content.array_records["arrays"].to_torch_state_dict().items()
        }
        out = ArrayRecord({k: v + 1 for k, v in state.items()})  # (Flower copies to host)
        metrics = MetricRecord({"num-examples": 1})
        return Message(RecordDict({"arrays": out, "metrics": metrics}), reply_to=msg)

    return app


def _round_trip(kind: str, state: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    from fl.net.transport import BulkGrid, TransportSettings
    from fl.run.engines.local import LocalGrid

    grid = BulkGrid(LocalGrid(_gpu_app(device), 1, {}), TransportSettings(name=kind, min_bytes=1))
    try:
        (node,) = grid.get_node_ids()
        start = time.perf_counter()
        message = Message(RecordDict({"arrays": ArrayRecord(state)}), node, "train")
        (reply,) = grid.send_and_receive([message], timeout=600)
        seconds = time.perf_counter() - start
        counts = grid.diagnostics()
    finally:
        grid.close()
    if reply.has_error():
        raise RuntimeError(f"{kind}: the node failed: {reply.error.reason}")
    back = reply.content.array_records["arrays"].to_torch_state_dict()
    exact = all(torch.equal(back[k], (v + 1).cpu()) for k, v in state.items())
    return {"exact": exact, "seconds": seconds, **counts}


def _vram_read(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A NIXL agent READs a host blob into a registered CUDA tensor (VRAM)."""
    from fl.net.transport.nixl_link import Agent

    source, reader = Agent(), Agent()
    host = bytearray(state["w"].cpu().numpy().tobytes())
    target = torch.empty(len(host), dtype=torch.uint8, device=state["w"].device)
    region = source.register(host)
    registration = reader._agent.register_memory([target])
    try:
        peer = reader._agent.add_remote_agent(base64.b64decode(region.metadata))
        local = reader._agent.get_xfer_descs([target])
        far = reader._agent.get_xfer_descs([(region.address, region.length, 0)], "DRAM")
        handle = reader._agent.initialize_xfer("READ", local, far, peer)
        start = time.perf_counter()
        status = reader._agent.transfer(handle)
        while status not in ("DONE", "ERR"):
            status = reader._agent.check_xfer_state(handle)
        seconds = time.perf_counter() - start
        reader._agent.release_xfer_handle(handle)
        reader._agent.remove_remote_agent(peer)
    finally:
        reader._agent.deregister_memory(registration)
        source.deregister(host)
    expected = torch.from_numpy(np.frombuffer(bytes(host), dtype=np.uint8).copy())
    exact = status == "DONE" and torch.equal(target.cpu(), expected)
    return {"exact": exact, "seconds": seconds, "gbps": len(host) / seconds / 1e9}


def cuda_bulk_check(size_mb: float = 46.8) -> dict[str, Any]:
    """Round trips of a CUDA state_dict through the side channel; {"cuda": False} without
    a GPU. Raises AssertionError if a round trip is not bit-exact."""
    from fl.net.transport import nixl_available

    if not torch.cuda.is_available():
        return {"cuda": False}
    device = torch.device("cuda")
    state = _state(size_mb, device)
    result: dict[str, Any] = {"cuda": True, "device": torch.cuda.get_device_name(device)}
    kinds = ["grpc"] + (["rdma"] if nixl_available() is None else [])
    for kind in kinds:
        result[kind] = _round_trip(kind, state, device)
    if nixl_available() is None:
        try:
            result["nixl_vram_read"] = _vram_read(state)
        except Exception as err:  # a UCX without CUDA support: reported, not fatal
            result["nixl_vram_read"] = {"error": f"{type(err).__name__}: {err}"}
    failed = [k for k in kinds if not result[k]["exact"] or result[k]["bulk_up"] != 1]
    assert not failed, f"not bit-exact or not on the side channel: {failed}: {result}"
    return result


def cohort_check(device: str = "cuda", clients: int = 1000, repeats: int = 3) -> dict[str, Any]:
    """Issue 30's figure on `device`: `experiments/bench_cohort.py` on the many-client
    benchmark's workload; {"skipped": why} without CUDA."""
    if device == "cuda" and not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the cohort timing needs a GPU"}
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from experiments.bench_cohort import SYNTHETIC, compare

    return compare(SYNTHETIC, clients, device, repeats)


def _cluster_failures(result: dict[str, Any]) -> list[str]:
    """Names of the cluster checks whose gradient or weights drifted from one process's."""
    failures = []
    for name in ("nccl", "gloo_cuda"):
        check = result.get(name)
        if isinstance(check, dict) and "grad_max_abs_diff" in check:
            drift = max(check["grad_max_abs_diff"], check["weights_max_abs_diff"])
            if drift > GRADIENT_TOLERANCE:
                failures.append(f"{name}: max |diff| {drift:.2e} > {GRADIENT_TOLERANCE}")
        elif isinstance(check, dict) and check.get("nccl_one_rank_allreduce_ok") is False:
            failures.append(f"{name}: the one-rank NCCL all-reduce returned wrong values")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--size-mb", type=float, default=46.8, help="bulk payload size")
    parser.add_argument("--cohort-clients", type=int, default=1000, help="clients in the cohort")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"cluster": gpu_cluster_check()}
    try:
        results["bulk"] = cuda_bulk_check(args.size_mb)
    except AssertionError as err:
        results["bulk"] = {"error": str(err)}
    results["cohort"] = cohort_check("cuda", args.cohort_clients)
    failures = _cluster_failures(results["cluster"])
    if "error" in results["bulk"]:
        failures.append(f"bulk: {results['bulk']['error']}")
    if results["cohort"].get("drift", 0.0) > DRIFT_TOLERANCE:
        failures.append(f"cohort: drift {results['cohort']['drift']:.1e} > {DRIFT_TOLERANCE}")
    results["failures"] = failures
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
