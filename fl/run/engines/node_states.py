"""Persistent node states of a simulated population, kept compactly and restored exactly.

A node's `Context.state` (a Flower `RecordDict`) lives here between the rounds it is
sampled in, as Flower's own protobuf bytes; nodes whose state is empty cost nothing.
Past a memory budget every state moves to a SQLite file, so a long run over millions of
stateful clients is bounded by disk, not RAM. The file is unlinked as soon as it is open:
it has no name while the run uses it, so a killed run leaves nothing behind and no other
process opens it by its path; a row that does not decode, or a statement the file cannot
answer, is a `NodeStateError`.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611

from fl.common.errors import RunError

__all__ = ["NodeStateError", "NodeStates"]

DEFAULT_MEMORY_BYTES = 256 * 2**20


def _encode(state: RecordDict) -> bytes:
    return bytes(recorddict_to_proto(state).SerializeToString())


class NodeStateError(RunError):
    """A saved node state that does not decode (a damaged spill file)."""


def _decode(data: bytes, node: int) -> RecordDict:
    try:
        return recorddict_from_proto(ProtoRecordDict.FromString(data))
    except Exception as err:  # protobuf's DecodeError, or a record Flower refuses
        raise NodeStateError(f"the saved state of node {node} does not decode: {err}") from None


class NodeStates(Mapping[int, RecordDict]):
    """node id -> its saved state (only nodes with a non-empty one); thread-safe.

    Reading a state decodes a fresh `RecordDict`, so what a ClientApp does to it is
    kept only once `put` back.
    """

    def __init__(
        self, spill_dir: Path | None = None, memory_bytes: int = DEFAULT_MEMORY_BYTES
    ) -> None:
        self.spill_dir = spill_dir
        self.memory_bytes = memory_bytes
        self._memory: dict[int, bytes] = {}
        self._held = 0  # bytes in `_memory`
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @property
    def spilled(self) -> bool:
        """Whether the states have moved to SQLite."""
        return self._db is not None

    def get_state(self, node: int) -> RecordDict:
        """The node's state, or an empty one if it has none."""
        data = self._read(node)
        return RecordDict() if data is None else _decode(data, node)

    def put(self, node: int, state: RecordDict) -> None:
        """Keep the node's state (an empty one is forgotten)."""
        data = _encode(state) if len(state) else None
        with self._lock:
            old = self._memory.pop(node, None)
            self._held -= len(old) if old is not None else 0
            if self._db is not None:
                if data is None:
                    self._sql("DELETE FROM states WHERE node = ?", (node,))
                else:
                    self._sql("REPLACE INTO states VALUES (?, ?)", (node, data))
                return
            if data is not None:
                self._memory[node] = data
                self._held += len(data)
            if self._held > self.memory_bytes:
                self._spill()

    def clear(self) -> None:
        """Forget every state."""
        with self._lock:
            self._memory.clear()
            self._held = 0
            if self._db is not None:
                self._sql("DELETE FROM states")

    def close(self) -> None:
        """Close the SQLite file, if the states spilled to one (it has no name: it goes)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # ----- Mapping (what a checkpoint saves) ----------------------------------------------
    def __getitem__(self, node: int) -> RecordDict:
        data = self._read(node)
        if data is None:
            raise KeyError(node)
        return _decode(data, node)

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            if self._db is None:
                return iter(list(self._memory))
            rows = self._sql("SELECT node FROM states ORDER BY node").fetchall()
        return iter([node for (node,) in rows])

    def __len__(self) -> int:
        with self._lock:
            if self._db is None:
                return len(self._memory)
            return int(self._sql("SELECT COUNT(*) FROM states").fetchone()[0])

    # ----- storage --------------------------------------------------------------------------
    def _sql(self, statement: str, params: tuple[object, ...] = ()) -> sqlite3.Cursor:
        """One statement on the spill file (under the lock); its failure is a NodeStateError."""
        assert self._db is not None
        try:
            return self._db.execute(statement, params)
        except sqlite3.Error as err:  # a damaged file: a dropped table, a full disk
            raise NodeStateError(f"the spilled node states cannot be used: {err}") from None

    def _read(self, node: int) -> bytes | None:
        with self._lock:
            if self._db is None:
                return self._memory.get(node)
            row = self._sql("SELECT state FROM states WHERE node = ?", (node,)).fetchone()
        return None if row is None else bytes(row[0])

    def _spill(self) -> None:
        """Move every state to a fresh SQLite file (under the lock)."""
        fd, name = tempfile.mkstemp(prefix="node-states-", suffix=".sqlite", dir=self.spill_dir)
        os.close(fd)
        # One writer (this process); losing the file loses nothing the checkpoint lacks.
        self._db = sqlite3.connect(name, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode = OFF")  # no -journal file beside it: one file
        self._db.execute("PRAGMA synchronous = OFF")
        self._db.execute("CREATE TABLE states (node INTEGER PRIMARY KEY, state BLOB NOT NULL)")
        os.unlink(name)  # open, nameless: nothing left after a kill, nothing to open by path
        self._db.executemany("INSERT INTO states VALUES (?, ?)", self._memory.items())
        self._memory.clear()
        self._held = 0
