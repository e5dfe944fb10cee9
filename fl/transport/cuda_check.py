"""CUDA tensors on the bulk path: the check a GPU machine runs (and that passes without one).

`cuda_bulk_check()` sends a ResNet-18-sized CUDA state_dict through a `BulkGrid` to an
in-process node whose ClientApp (behind `bulk_mod`) loads it onto the GPU, adds one there
and replies; the reply must equal the same computation done directly on the GPU, bit for
bit, for `grpc` and (where NIXL imports) `rdma`. Where NIXL imports it also registers a
CUDA tensor with a NIXL agent (VRAM) and READs a host blob into it. Without CUDA it returns
`{"cuda": False}` and checks nothing.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

__all__ = ["cuda_bulk_check"]


def _state(size_mb: float, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    count = int(size_mb * 1e6 / 4)
    return {"w": torch.randn(count, generator=gen).to(device), "step": torch.tensor(3).to(device)}


def _gpu_app(device: torch.device) -> ClientApp:
    from fl.transport import bulk_mod

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
    from fl.engines.local import LocalGrid
    from fl.transport import BulkGrid, TransportSettings

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
    from fl.transport.nixl_link import Agent

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
    from fl.transport import nixl_available

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
