"""The privacy-budget ledger: data blocks, pipelines, grants and ε charges in SQLite (WAL).

Every change is one `BEGIN IMMEDIATE` transaction, so concurrent submitters in several
processes are serialised by SQLite's write lock, and a process killed mid-transaction
leaves nothing behind (WAL recovery drops uncommitted frames). The budget invariants are
enforced by the database itself, not only by this code: triggers keep each block's
`allocated` and each grant's `spent` current, and CHECK constraints abort any statement
that would take them past the budget or the grant.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from privacy.dpbalance import Block, Grant, Pipeline, Problem, Scheduler

__all__ = ["BudgetExceeded", "Ledger", "LedgerError", "PipelineRecord"]

SLACK = 1e-9  # float tolerance of the CHECKs (allocations are computed in float64)

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS blocks (
    id TEXT PRIMARY KEY,
    budget REAL NOT NULL CHECK (budget >= 0),
    allocated REAL NOT NULL DEFAULT 0,
    arrivals INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    CHECK (allocated >= -{SLACK} AND allocated <= budget + {SLACK})
);
CREATE TABLE IF NOT EXISTS pipelines (
    id TEXT PRIMARY KEY,
    analyst TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('waiting', 'granted', 'finished', 'stopped')),
    arrival REAL NOT NULL,
    loss REAL NOT NULL DEFAULT 1.0,
    kappa REAL,
    note TEXT
);
CREATE TABLE IF NOT EXISTS demands (
    pipeline TEXT NOT NULL REFERENCES pipelines(id),
    block TEXT NOT NULL REFERENCES blocks(id),
    epsilon REAL NOT NULL CHECK (epsilon > 0),
    PRIMARY KEY (pipeline, block)
);
CREATE TABLE IF NOT EXISTS allocations (
    pipeline TEXT NOT NULL REFERENCES pipelines(id),
    block TEXT NOT NULL REFERENCES blocks(id),
    epsilon REAL NOT NULL CHECK (epsilon >= 0),
    spent REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (pipeline, block),
    CHECK (spent >= 0 AND spent <= epsilon + {SLACK})
);
CREATE TABLE IF NOT EXISTS charges (
    pipeline TEXT NOT NULL,
    block TEXT NOT NULL,
    round INTEGER NOT NULL,
    epsilon REAL NOT NULL CHECK (epsilon >= 0),
    PRIMARY KEY (pipeline, block, round),
    FOREIGN KEY (pipeline, block) REFERENCES allocations(pipeline, block)
);
CREATE TRIGGER IF NOT EXISTS allocation_takes_budget AFTER INSERT ON allocations
BEGIN
    UPDATE blocks SET allocated = allocated + NEW.epsilon WHERE id = NEW.block;
END;
CREATE TRIGGER IF NOT EXISTS allocation_returns_budget AFTER UPDATE OF epsilon ON allocations
BEGIN
    UPDATE blocks SET allocated = allocated - OLD.epsilon + NEW.epsilon WHERE id = NEW.block;
END;
CREATE TRIGGER IF NOT EXISTS charge_spends_grant AFTER INSERT ON charges
BEGIN
    UPDATE allocations SET spent = spent + NEW.epsilon
    WHERE pipeline = NEW.pipeline AND block = NEW.block;
END;
"""


class LedgerError(RuntimeError):
    """A request the ledger refuses: unknown block or pipeline, wrong state, over budget."""


class BudgetExceeded(LedgerError):
    """A grant or charge that would take a block past its budget or a pipeline past its grant."""


@dataclass(frozen=True)
class PipelineRecord:
    """A pipeline as the ledger knows it: state, κ and per-block grant and spend."""

    id: str
    analyst: str
    status: str
    kappa: float | None
    granted: dict[str, float]
    spent: dict[str, float]
    note: str | None


class Ledger:
    """One connection to a ledger file; open one per process (or per thread)."""

    def __init__(self, path: str | Path, *, timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
        self.db.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = FULL")  # a committed charge survives power loss
        self.db.execute("PRAGMA foreign_keys = ON")
        (tables,) = self.db.execute(
            "SELECT COUNT(*) FROM sqlite_master WHERE type IN ('table', 'trigger')"
        ).fetchone()
        if tables < SCHEMA.count("CREATE "):
            self._create_schema()

    def _create_schema(self) -> None:
        try:  # executescript commits as it goes, so the script carries its own transaction
            self.db.executescript("BEGIN IMMEDIATE;" + SCHEMA + "COMMIT;")
        except sqlite3.Error:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ----- blocks and pipelines -----------------------------------------------------------
    def add_blocks(self, budgets: Mapping[str, float], *, now: float | None = None) -> int:
        """Create the blocks that do not exist yet (existing budgets are kept); count created."""
        created = time.time() if now is None else now
        with self.transaction() as db:
            before = db.total_changes
            db.executemany(
                "INSERT OR IGNORE INTO blocks (id, budget, created) VALUES (?, ?, ?)",
                [(b, float(e), created) for b, e in budgets.items()],
            )
            return db.total_changes - before

    def submit(self, pipeline: Pipeline) -> None:
        """Register a waiting pipeline and its demand; every demanded block must exist."""
        with self.transaction() as db:
            try:
                db.execute(
                    "INSERT INTO pipelines (id, analyst, status, arrival, loss) "
                    "VALUES (?, ?, 'waiting', ?, ?)",
                    (pipeline.id, pipeline.analyst, pipeline.arrival, pipeline.loss),
                )
                db.executemany(
                    "INSERT INTO demands (pipeline, block, epsilon) VALUES (?, ?, ?)",
                    [(pipeline.id, b, float(e)) for b, e in pipeline.demand.items()],
                )
            except sqlite3.IntegrityError as err:
                raise LedgerError(f"cannot submit pipeline {pipeline.id!r}: {err}") from err
            db.executemany(
                "UPDATE blocks SET arrivals = arrivals + 1 WHERE id = ?",
                [(b,) for b in pipeline.demand],
            )

    def set_status(self, pipeline: str, status: str, note: str | None = None) -> None:
        """Mark a pipeline finished or stopped (with a note saying why).

        Its grant shrinks to what it spent, in the same transaction: the unspent rest of
        each block's grant goes back to the block for later pipelines.
        """
        if status not in ("finished", "stopped"):
            raise LedgerError(f"status must be finished or stopped, not {status!r}")
        with self.transaction() as db:
            db.execute(
                "UPDATE pipelines SET status = ?, note = COALESCE(?, note) WHERE id = ?",
                (status, note, pipeline),
            )
            db.execute(
                "UPDATE allocations SET epsilon = spent WHERE pipeline = ? AND epsilon > spent",
                (pipeline,),
            )

    # ----- scheduling ---------------------------------------------------------------------
    def problem(self, now: float) -> Problem:
        """The current scheduling problem: all blocks and the waiting pipelines."""
        blocks = {
            b: Block(b, budget, max(budget - allocated, 0.0), arrivals)
            for b, budget, allocated, arrivals in self.db.execute(
                "SELECT id, budget, allocated, arrivals FROM blocks"
            )
        }
        demand: dict[str, dict[str, float]] = {}
        for pipeline, block, epsilon in self.db.execute(
            "SELECT d.pipeline, d.block, d.epsilon FROM demands d "
            "JOIN pipelines p ON p.id = d.pipeline WHERE p.status = 'waiting'"
        ):
            demand.setdefault(pipeline, {})[block] = epsilon
        pipelines = [
            Pipeline(pid, analyst, demand.get(pid, {}), arrival, loss)
            for pid, analyst, arrival, loss in self.db.execute(
                "SELECT id, analyst, arrival, loss FROM pipelines "
                "WHERE status = 'waiting' ORDER BY arrival, rowid"
            )
        ]
        return Problem(blocks, pipelines, now)

    def allocate(
        self, grants: Sequence[Grant], *, before_commit: Callable[[], None] | None = None
    ) -> None:
        """Record grants of waiting pipelines, all or none, in one transaction.

        `before_commit` runs inside the open transaction (crash tests kill the process there).
        """
        with self.transaction() as db:
            self._write_grants(db, grants)
            if before_commit is not None:
                before_commit()

    def schedule(
        self,
        scheduler: Scheduler,
        now: float | None = None,
        *,
        before_commit: Callable[[], None] | None = None,
    ) -> list[Grant]:
        """One scheduling round: read, decide and record under one write lock."""
        with self.transaction() as db:
            grants = scheduler.allocate(self.problem(time.time() if now is None else now))
            self._write_grants(db, grants)
            if before_commit is not None:
                before_commit()
        return grants

    def _write_grants(self, db: sqlite3.Connection, grants: Sequence[Grant]) -> None:
        for grant in grants:
            row = db.execute(
                "SELECT status FROM pipelines WHERE id = ?", (grant.pipeline,)
            ).fetchone()
            if row is None or row[0] != "waiting":
                raise LedgerError(f"pipeline {grant.pipeline!r} is not waiting for a grant")
            try:
                db.executemany(
                    "INSERT INTO allocations (pipeline, block, epsilon) VALUES (?, ?, ?)",
                    [(grant.pipeline, b, float(e)) for b, e in grant.epsilon.items()],
                )
            except sqlite3.IntegrityError as err:
                reason = self._overfull(db, grant)
                raise BudgetExceeded(
                    f"grant of pipeline {grant.pipeline!r} does not fit: {reason}"
                ) from err
            db.execute(
                "UPDATE pipelines SET status = 'granted', kappa = ? WHERE id = ?",
                (grant.kappa, grant.pipeline),
            )

    def _overfull(self, db: sqlite3.Connection, grant: Grant) -> str:
        for block, epsilon in grant.epsilon.items():
            row = db.execute(
                "SELECT budget, allocated FROM blocks WHERE id = ?", (block,)
            ).fetchone()
            if row is None:
                return f"no block {block!r}"
            if row[1] + epsilon > row[0] + SLACK:
                return (
                    f"block {block!r} has {row[0] - row[1]:.6g} of {row[0]:.6g} left, "
                    f"asked {epsilon:.6g}"
                )
        return "constraint failed"

    # ----- spending -----------------------------------------------------------------------
    def charge(self, pipeline: str, round_: int, spend: Mapping[str, float]) -> bool:
        """Charge one round's ε spend per block against the pipeline's grant, all or none.

        Idempotent per (pipeline, block, round): a round re-run after a crash is charged
        once. Returns False when the round had already been charged. Raises BudgetExceeded
        (and charges nothing) when any block would go past the grant.
        """
        with self.transaction() as db:
            before = db.total_changes
            for block, epsilon in spend.items():
                if db.execute(
                    "SELECT 1 FROM charges WHERE pipeline = ? AND block = ? AND round = ?",
                    (pipeline, block, round_),
                ).fetchone():
                    continue
                grant = db.execute(
                    "SELECT epsilon, spent FROM allocations WHERE pipeline = ? AND block = ?",
                    (pipeline, block),
                ).fetchone()
                if grant is None:
                    raise BudgetExceeded(f"pipeline {pipeline!r} has no grant on block {block!r}")
                try:
                    db.execute(
                        "INSERT INTO charges (pipeline, block, round, epsilon) VALUES (?, ?, ?, ?)",
                        (pipeline, block, round_, float(epsilon)),
                    )
                except sqlite3.IntegrityError as err:
                    raise BudgetExceeded(
                        f"pipeline {pipeline!r} would spend ε={grant[1] + epsilon:.6g} on block "
                        f"{block!r} in round {round_}, above its grant of {grant[0]:.6g}"
                    ) from err
            return db.total_changes > before

    # ----- reading and auditing -----------------------------------------------------------
    def pipeline(self, pipeline: str) -> PipelineRecord | None:
        """A pipeline's state, or None if the ledger does not know it."""
        row = self.db.execute(
            "SELECT analyst, status, kappa, note FROM pipelines WHERE id = ?", (pipeline,)
        ).fetchone()
        if row is None:
            return None
        rows = self.db.execute(
            "SELECT block, epsilon, spent FROM allocations WHERE pipeline = ?", (pipeline,)
        ).fetchall()
        return PipelineRecord(
            pipeline,
            row[0],
            row[1],
            row[2],
            {b: e for b, e, _ in rows},
            {b: s for b, _, s in rows},
            row[3],
        )

    def blocks(self) -> dict[str, tuple[float, float]]:
        """(budget, allocated) of every block."""
        return {
            b: (budget, allocated)
            for b, budget, allocated in self.db.execute("SELECT id, budget, allocated FROM blocks")
        }

    def check(self) -> list[str]:
        """Every violated invariant, in words; empty when the ledger is consistent."""
        problems = []
        for block, budget, allocated, total in self.db.execute(
            "SELECT b.id, b.budget, b.allocated, COALESCE(SUM(a.epsilon), 0) FROM blocks b "
            "LEFT JOIN allocations a ON a.block = b.id GROUP BY b.id"
        ):
            if abs(allocated - total) > SLACK:
                problems.append(f"block {block}: allocated {allocated} != sum of grants {total}")
            if total > budget + SLACK:
                problems.append(f"block {block}: grants {total} exceed budget {budget}")
        for pipeline, block, epsilon, spent, total in self.db.execute(
            "SELECT a.pipeline, a.block, a.epsilon, a.spent, COALESCE(SUM(c.epsilon), 0) "
            "FROM allocations a LEFT JOIN charges c "
            "ON c.pipeline = a.pipeline AND c.block = a.block GROUP BY a.pipeline, a.block"
        ):
            if abs(spent - total) > SLACK:
                problems.append(f"{pipeline}@{block}: spent {spent} != sum of charges {total}")
            if total > epsilon + SLACK:
                problems.append(f"{pipeline}@{block}: charges {total} exceed grant {epsilon}")
        for (pipeline,) in self.db.execute(
            "SELECT p.id FROM pipelines p WHERE p.status = 'waiting' "
            "AND EXISTS (SELECT 1 FROM allocations a WHERE a.pipeline = p.id)"
        ):
            problems.append(f"{pipeline}: waiting but holds allocations")
        (integrity,) = self.db.execute("PRAGMA integrity_check").fetchone()
        if integrity != "ok":
            problems.append(f"integrity_check: {integrity}")
        return problems
