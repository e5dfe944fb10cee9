"""Shared-memory segments between a node's bulk agent (the sidecar) and its ClientApps.

A segment is an anonymous memory file (`memfd_create`) that the sidecar maps, registers
with NIXL once, and hands to a ClientApp process as a file descriptor over a Unix socket
(SCM_RIGHTS). The file has no name anywhere, so nothing is left behind when either
process dies, and nobody can open it by guessing a path. Its size is sealed
(`F_SEAL_SHRINK | F_SEAL_GROW`): a ClientApp cannot truncate it under the sidecar's
mapping (which would crash the sidecar with SIGBUS on its next access). A download segment
is also sealed against writes (`F_SEAL_FUTURE_WRITE`) once the sidecar has mapped it: only
that mapping may write, so a ClientApp that reopens its read-only descriptor read-write
through /proc/self/fd cannot change bytes that the next ClientApp reads after its check.

`SegmentPool` keeps finished segments for reuse (their NIXL registration and touched
pages included), within a byte limit.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

__all__ = ["Segment", "SegmentError", "SegmentPool", "map_segment"]

GRAIN = 2**20  # capacities are rounded up to this, so near sizes share segments
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Linux >= 5.1; Python's fcntl names it from 3.12 on
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SegmentError(RuntimeError):
    """A segment that cannot be made, leased or mapped."""


@dataclass(eq=False)
class Segment:
    """One sealed memory file and the sidecar's writable mapping of it."""

    fd: int
    capacity: int
    memory: mmap.mmap
    registered: bool = False  # with the sidecar's NIXL agent
    uses: int = field(default=0)

    @classmethod
    def create(cls, capacity: int, *, peer_writes: bool = True) -> Segment:
        """A new segment; unless `peer_writes`, only the mapping made here can write it."""
        fd = os.memfd_create("fl-bulk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, capacity)
            flags = mmap.MAP_SHARED | _POPULATE
            memory = mmap.mmap(fd, capacity, flags=flags) if capacity else mmap.mmap(-1, 1)
            seals = _SEALS if peer_writes else _SEALS | F_SEAL_FUTURE_WRITE
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, capacity, memory)

    def view(self, nbytes: int) -> memoryview:
        """The first `nbytes` of the segment (writable)."""
        return memoryview(self.memory)[:nbytes]

    def close(self) -> None:
        try:
            with suppress(BufferError):  # a view is still in use: the mapping goes with it
                self.memory.close()
        finally:
            os.close(self.fd)


class SegmentPool:
    """Segments leased to one request at a time and kept for reuse, within `max_bytes`.

    `lease(nbytes)` gives the smallest free segment that holds `nbytes` (or a new one);
    `give_back` returns it. Free segments are closed, largest first, when a new one would
    not fit under the limit; a lease that cannot fit even then is refused. `on_close`
    runs before a segment is closed (the sidecar deregisters it from NIXL there).
    `peer_writes`: whether the processes a segment is lent to write it (uploads) or only
    read it (downloads: sealed against their writes).
    """

    def __init__(
        self,
        max_bytes: int,
        on_close: Callable[[Segment], None] | None = None,
        *,
        peer_writes: bool = True,
    ):
        self.max_bytes = max_bytes
        self.peer_writes = peer_writes
        self._on_close = on_close
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._leased: set[Segment] = set()
        self._creating = 0  # bytes of segments being made

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def lease(self, nbytes: int) -> Segment:
        if not 0 <= nbytes <= self.max_bytes:
            raise SegmentError(f"{nbytes} B is over the agent's limit of {self.max_bytes} B")
        capacity = -(-nbytes // GRAIN) * GRAIN
        with self._lock:
            fits = [s for s in self._free if s.capacity >= nbytes]
            if fits:
                segment = min(fits, key=lambda s: s.capacity)
                self._free.remove(segment)
                self._leased.add(segment)
                segment.uses += 1
                return segment
            held = self._held()
            doomed = []
            for old in sorted(self._free, key=lambda s: -s.capacity):
                if held + capacity <= self.max_bytes:
                    break
                doomed.append(old)
                held -= old.capacity
            if held + capacity > self.max_bytes:
                raise SegmentError(f"{nbytes} B do not fit: {held} B of {self.max_bytes} B in use")
            for old in doomed:
                self._free.remove(old)
            self._creating += capacity
        try:  # (outside the lock: making a large segment takes a while)
            for old in doomed:
                self._close(old)
            segment = Segment.create(capacity, peer_writes=self.peer_writes)
        except BaseException:
            with self._lock:
                self._creating -= capacity
            raise
        with self._lock:
            self._creating -= capacity
            self._leased.add(segment)
            segment.uses += 1
        return segment

    def _held(self) -> int:
        return sum(s.capacity for s in (*self._free, *self._leased)) + self._creating

    def give_back(self, segment: Segment) -> None:
        with self._lock:
            self._leased.discard(segment)
            self._free.append(segment)

    def discard(self, segment: Segment) -> None:
        """Close a leased segment instead of keeping it (its contents are suspect)."""
        with self._lock:
            self._leased.discard(segment)
        self._close(segment)

    def close(self) -> None:
        """Close every segment, free or leased."""
        with self._lock:
            segments = [*self._free, *self._leased]
            self._free.clear()
            self._leased.clear()
        for segment in segments:
            self._close(segment)

    def _close(self, segment: Segment) -> None:
        try:
            if self._on_close is not None:
                self._on_close(segment)
        finally:
            segment.close()


def map_segment(fd: int, nbytes: int, *, writable: bool) -> mmap.mmap:
    """A ClientApp's mapping of the first `nbytes` of a segment the sidecar sent (the fd
    is closed here: the mapping keeps the memory). The fd must be a regular file at
    least `nbytes` long."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < nbytes:
            raise SegmentError(f"the agent's segment is not a file of at least {nbytes} B")
        if not nbytes:
            return mmap.mmap(-1, 1)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # MAP_POPULATE: the pages in one call, not one fault per 4 KiB (2-3x faster here)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE, prot=prot)
    finally:
        os.close(fd)
