"""NIXL (ai-dynamo) one-sided transfers for `transport=rdma`: an optional extra.

NIXL's wheel bundles a UCX with InfiniBand, RoCE and EFA transports; on a host without
an RDMA NIC, UCX moves the bytes by cross-memory attach, shared memory or TCP. Each
process has one agent; the agent metadata and buffer addresses travel over the gRPC
control calls of `fl.transport.service`, the bytes by a one-sided READ (download) or
WRITE (upload) that the node starts. Install with `pip install -e '.[rdma]'`.
"""

from __future__ import annotations

import base64
import functools
import os
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Agent", "Region", "TransportUnavailable", "agent", "nixl_available"]

POLL_S = 0.0005


class TransportUnavailable(RuntimeError):
    """The configured side channel cannot run on this machine."""


@functools.cache
def nixl_available() -> str | None:
    """None when NIXL imports; else why not."""
    try:
        import nixl._api  # noqa: F401
    except Exception as err:  # an optional extra: any import failure means absent
        return f"{type(err).__name__}: {err}"
    return None


@dataclass(frozen=True)
class Region:
    """A registered buffer as the other side needs it: the agent and where the bytes are."""

    agent: str
    metadata: str  # base64 of the agent's metadata
    address: int
    length: int

    def to_json(self) -> dict[str, Any]:
        return {"agent": self.agent, "metadata": self.metadata, "address": self.address,
                "length": self.length}  # fmt: skip

    @classmethod
    def from_json(cls, value: Any) -> Region:
        """A region from a control reply (untrusted: typed and bounded here)."""
        try:
            region = cls(
                str(value["agent"]),
                str(value["metadata"]),
                int(value["address"]),
                int(value["length"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed NIXL region: {err}") from err
        if region.address < 0 or region.length < 0:
            raise ValueError("malformed NIXL region: negative address or length")
        return region


class Agent:
    """This process's NIXL agent: registers buffers and moves bytes to or from peers."""

    def __init__(self) -> None:
        reason = nixl_available()
        if reason is not None:
            raise TransportUnavailable(
                "transport=rdma needs NIXL (`pip install -e '.[rdma]'`), which does not "
                f"import here: {reason}"
            )
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"fl-{os.getpid()}-{os.urandom(4).hex()}"
        self._agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self._registered: dict[int, Any] = {}  # id of the buffer -> its registration

    @staticmethod
    def _address(buffer: bytearray) -> int:
        import numpy as np

        return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) if buffer else 0

    def register(self, buffer: bytearray) -> Region:
        """Make `buffer` reachable by peers (idempotent); its region for them."""
        address = self._address(buffer)
        if id(buffer) not in self._registered:
            self._registered[id(buffer)] = self._agent.register_memory(
                [(address, len(buffer), 0, "")], "DRAM"
            )
        metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        return Region(self.name, metadata, address, len(buffer))

    def deregister(self, buffer: bytearray) -> None:
        registration = self._registered.pop(id(buffer), None)
        if registration is not None:
            self._agent.deregister_memory(registration)

    def transfer(self, operation: str, buffer: bytearray, remote: Region, timeout_s: float) -> None:
        """READ `remote` into `buffer`, or WRITE `buffer` to `remote` (same length)."""
        if remote.length != len(buffer):
            raise ValueError(f"remote region holds {remote.length} B, the buffer {len(buffer)}")
        self.register(buffer)
        peer = self._agent.add_remote_agent(base64.b64decode(remote.metadata))
        local = self._agent.get_xfer_descs([(self._address(buffer), len(buffer), 0)], "DRAM")
        far = self._agent.get_xfer_descs([(remote.address, remote.length, 0)], "DRAM")
        handle = self._agent.initialize_xfer(operation, local, far, peer)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL {operation} of {len(buffer)} B timed out")
                time.sleep(POLL_S)
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise OSError(f"NIXL {operation} of {len(buffer)} B failed")
        finally:
            self._agent.release_xfer_handle(handle)
            self.deregister(buffer)
            self._agent.remove_remote_agent(peer)


@functools.cache
def agent() -> Agent:
    """The process's agent, made on first use."""
    return Agent()
