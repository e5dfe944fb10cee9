"""NIXL (ai-dynamo) one-sided transfers for `transport=rdma`: an optional extra.

NIXL's wheel bundles a UCX with InfiniBand, RoCE and EFA transports; on a host without
an RDMA NIC, UCX moves the bytes by cross-memory attach, shared memory or TCP. Each
process has one agent (a node's long-lived one lives in its sidecar,
`fl.net.transport.sidecar`); the agent metadata and buffer addresses travel over the gRPC
control calls of `fl.net.transport.service`, the bytes by a one-sided READ (download) or
WRITE (upload) that the node starts. Install with `pip install -e '.[rdma]'`.
"""

from __future__ import annotations

import base64
import functools
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Agent", "Buffer", "Region", "TransportUnavailable", "agent", "nixl_available"]

POLL_S = 0.0005
MAX_PEERS = 32
PROGRESS_DELAY_US = 1000  # the agent's progress thread: a poll every millisecond, not a spin
Buffer = bytearray | memoryview | mmap.mmap  # memory a transfer reads or writes


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
    """This process's NIXL agent: registers buffers and moves bytes to or from peers.

    Thread-safe (one lock). Remote agents stay loaded once added (a node's sidecar talks
    to the same server agent every round; reloading changed metadata is cheap, a new
    connection is not), up to `MAX_PEERS`, the oldest dropped first.
    """

    def __init__(self) -> None:
        reason = nixl_available()
        if reason is not None:
            raise TransportUnavailable(
                "transport=rdma needs NIXL (`pip install -e '.[rdma]'`), which does not "
                f"import here: {reason}"
            )
        self.name = f"fl-{os.getpid()}-{os.urandom(4).hex()}"
        self._agent = _nixl_agent(self.name)
        self._lock = threading.RLock()
        # id of the buffer -> (its address, its length, the registration)
        self._registered: dict[int, tuple[int, int, Any]] = {}
        self._peers: dict[str, bytes] = {}  # remote agent -> the metadata loaded for it

    @staticmethod
    def _address(buffer: Buffer) -> int:
        import numpy as np

        return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) if len(buffer) else 0

    def register(self, buffer: Buffer) -> Region:
        """Make `buffer` reachable by peers (idempotent); its region for them."""
        address, length = self._address(buffer), len(buffer)
        with self._lock:
            if id(buffer) not in self._registered:
                registration = self._agent.register_memory([(address, length, 0, "")], "DRAM")
                self._registered[id(buffer)] = (address, length, registration)
            metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        return Region(self.name, metadata, address, length)

    def deregister(self, buffer: Buffer) -> None:
        with self._lock:
            entry = self._registered.pop(id(buffer), None)
            if entry is not None:
                self._agent.deregister_memory(entry[2])

    def _covered(self, address: int, length: int) -> bool:
        spans = ((a, n) for a, n, _ in self._registered.values())
        return any(a <= address and address + length <= a + n for a, n in spans)

    def _peer(self, remote: Region) -> str:
        """The remote agent, loaded (or its metadata refreshed) when needed."""
        metadata = base64.b64decode(remote.metadata)
        if self._peers.get(remote.agent) != metadata:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers.pop(name, None)
            if name != remote.agent:
                raise ValueError(f"region names agent {remote.agent!r}, its metadata {name!r}")
            self._peers[name] = metadata
            while len(self._peers) > MAX_PEERS:
                oldest = next(iter(self._peers))
                del self._peers[oldest]
                self._agent.remove_remote_agent(oldest)
        return remote.agent

    def transfer(self, operation: str, buffer: Buffer, remote: Region, timeout_s: float) -> None:
        """READ `remote` into `buffer`, or WRITE `buffer` to `remote` (same length).
        `buffer` may lie inside a registered one; otherwise it is registered for this
        transfer only."""
        if remote.length != len(buffer):
            raise ValueError(f"remote region holds {remote.length} B, the buffer {len(buffer)}")
        address = self._address(buffer)
        with self._lock:
            own = not self._covered(address, len(buffer))
            if own:
                self.register(buffer)
            try:
                self._move(operation, address, len(buffer), remote, timeout_s)
            finally:
                if own:
                    self.deregister(buffer)

    def _move(
        self, operation: str, address: int, length: int, remote: Region, timeout_s: float
    ) -> None:
        peer = self._peer(remote)
        local = self._agent.get_xfer_descs([(address, length, 0)], "DRAM")
        far = self._agent.get_xfer_descs([(remote.address, remote.length, 0)], "DRAM")
        handle = self._agent.initialize_xfer(operation, local, far, peer)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL {operation} of {length} B timed out")
                time.sleep(POLL_S)
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise OSError(f"NIXL {operation} of {length} B failed")
        finally:
            self._agent.release_xfer_handle(handle)


_CONFIG_LOCK = threading.Lock()


def _nixl_agent(name: str) -> Any:
    """A NIXL agent (UCX backend) whose progress thread sleeps `PROGRESS_DELAY_US` between
    polls. NIXL 1.5.1's Python wrapper always sets the delay to 0: a thread that spins on
    a whole core for the agent's life (measured: 8 % of a core at nice 19 on a loaded
    2-core host, a full core when idle), in the ServerApp and in every node's agent. A
    config subclass that keeps our delay is the only way in; should the wrapper change,
    the agent is made as it comes."""
    import nixl._api as api

    config = api.nixl_agent_config(backends=["UCX"])
    try:
        base = api.nixlBind.nixlAgentConfig

        class _Config(base):  # type: ignore[misc, valid-type]
            def __setattr__(self, key: str, value: Any) -> None:
                super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    except (AttributeError, TypeError):  # another wrapper: its own progress thread
        return api.nixl_agent(name, config)
    with _CONFIG_LOCK:
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


@functools.cache
def agent() -> Agent:
    """The process's agent, made on first use."""
    return Agent()
