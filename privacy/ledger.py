"""The privacy-budget ledger: blocks, pipelines, leases, grants and (ε, δ) charges in SQLite (WAL).

Why one module: every write below is one transaction over the same connection,
opened by `transaction()` with its lease reclaim, so the writes, the lease machinery and
the reads they make inside that transaction stay one class (the schema and the invariant
check, which need no transaction, are in `privacy.ledger_schema`).

Every change is one `BEGIN IMMEDIATE` transaction, so concurrent submitters in several
processes are serialised by SQLite's write lock, and a process killed mid-transaction
leaves nothing behind (WAL recovery drops uncommitted frames). The budget invariants are
enforced by the database itself, not only by this code: triggers keep each block's
`allocated` and each grant's `spent` current (ε and δ), and CHECK constraints abort any
statement that would take them past the budget or the grant. ε and δ compose by basic
composition: they add.

A pipeline claimed by a run carries a lease that its holder renews by heartbeat. Every
write transaction first reclaims the leases that lapsed (a waiting pipeline is cancelled,
a granted one expires and its unspent grant returns to the blocks), so a crashed run's
budget comes back with the next write by anyone, and the reclaim commits or rolls back
with that write. No grant is written on a ledger whose invariants do not hold.
"""

from __future__ import annotations

import os
import random
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from fl.common.files import NotRegularFile, make_dir, require_writable
from privacy.dpbalance import Block, Grant, Pipeline, Problem, Scheduler
from privacy.ledger_schema import DSLACK, ROOM, SCHEMA, SLACK, VERSION, check_invariants

__all__ = [
    "BudgetExceeded",
    "LeaseLost",
    "Ledger",
    "LedgerError",
    "LedgerInconsistent",
    "PipelineRecord",
    "new_holder",
]

LIVE = ("waiting", "granted")
# what a pipeline may become, and from which status
ENDS = {"finished": "granted", "stopped": "granted", "released": "granted", "cancelled": "waiting"}


class LedgerError(RuntimeError):
    """A request the ledger refuses: unknown block or pipeline, wrong state, over budget."""


class BudgetExceeded(LedgerError):
    """A grant or charge that would take a block past its budget or a pipeline past its grant."""


class LedgerInconsistent(LedgerError):
    """A grant asked of a ledger whose invariants do not hold (tampered with, or corrupt)."""


class LeaseLost(LedgerError):
    """A holder's heartbeat or charge on a pipeline it no longer holds (lapsed or released)."""


@dataclass(frozen=True)
class PipelineRecord:
    """A pipeline as the ledger knows it: state, κ, lease and per-block (ε, δ) grant and spend."""

    id: str
    analyst: str
    status: str
    kappa: float | None
    granted: dict[str, float]
    spent: dict[str, float]
    note: str | None
    delta_granted: dict[str, float]
    delta_spent: dict[str, float]
    holder: str | None
    lease_until: float | None


def new_holder() -> str:
    """A lease holder's name: host and pid for people, a random part for uniqueness."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# what SQLite keeps beside a ledger file (WAL mode: -wal and -shm; a rollback: -journal)
_COMPANIONS = ("", "-wal", "-shm", "-journal")


def _refuse_links(path: Path) -> None:
    """LedgerError if the ledger or a file SQLite keeps beside it is a link or anything but
    a regular file: SQLite would follow a link, and a budget is never written elsewhere."""
    for suffix in _COMPANIONS:
        try:
            require_writable(f"{path}{suffix}")
        except NotRegularFile as err:
            raise LedgerError(f"refused: {err}") from None


class Ledger:
    """One connection to a ledger file; open one per process (or per thread).

    `create=False` opens an existing ledger only: a missing file is refused, not created.
    `readonly=True` (inspection) opens it without writing anything, not even a reclaim.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        timeout_s: float = 60.0,
        create: bool = True,
        readonly: bool = False,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.reclaimed: list[str] = []  # pipelines the last write transaction's reclaim ended
        create = create and not readonly
        if create:  # its folder too is no link: a swapped folder would hold a fresh ledger
            try:
                make_dir(self.path.parent)
            except NotRegularFile as err:
                raise LedgerError(f"refused: {err}") from None
        _refuse_links(self.path)
        mode = "ro" if readonly else "rwc" if create else "rw"
        uri = f"file:{quote(str(self.path.absolute()))}?mode={mode}"
        try:
            self.db = sqlite3.connect(uri, uri=True, timeout=timeout_s, isolation_level=None)
        except sqlite3.OperationalError as err:
            raise LedgerError(f"no ledger at {self.path} ({err})") from None
        try:
            _refuse_links(self.path)  # again, now that it is open: no link swapped in between
            self.db.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
            self._setup(create, time.monotonic() + timeout_s)
        except BaseException:
            self.db.close()
            raise

    def _setup(self, create: bool, deadline: float) -> None:
        """Refuse a file that is not a ledger; WAL, durability, foreign keys; a new schema."""
        tables, version = self.db.execute(  # one read: a creator may commit in between
            "SELECT (SELECT COUNT(*) FROM sqlite_master), user_version FROM pragma_user_version"
        ).fetchone()
        if tables and version != VERSION:
            raise LedgerError(
                f"{self.path} is not a ledger of schema version {VERSION} (it has {version})"
            )
        if tables == 0 and not create:
            raise LedgerError(f"{self.path} is not a ledger (no tables)")
        if self.readonly:
            return
        while True:  # switching a new file to WAL fails at once, without the busy handler,
            try:  # while another first opener holds the write lock: retry until the deadline
                self.db.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(random.uniform(0.01, 0.05))
        self.db.execute("PRAGMA synchronous = FULL")  # a committed charge survives power loss
        self.db.execute("PRAGMA foreign_keys = ON")
        if tables == 0:
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
        """BEGIN IMMEDIATE, reclaim lapsed leases, ... COMMIT; rolled back on any exception."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.reclaimed = self._reclaim(self.db, time.time())
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ----- leases ---------------------------------------------------------------------------
    def _reclaim(self, db: sqlite3.Connection, now: float) -> list[str]:
        """End every live pipeline whose lease lapsed; the pipelines it ended."""
        lapsed = db.execute(
            "SELECT id, status, holder, lease_until FROM pipelines "
            "WHERE status IN ('waiting', 'granted') AND lease_until < ? ORDER BY rowid",
            (now,),
        ).fetchall()
        for pipeline, status, holder, until in lapsed:
            note = f"lease lapsed at {_clock(until)}: no heartbeat from {holder}"
            self._end(db, pipeline, "cancelled" if status == "waiting" else "expired", note)
        return [pipeline for pipeline, *_ in lapsed]

    def reclaim(self) -> list[str]:
        """Reclaim lapsed leases now (every write does it first); the pipelines it ended."""
        with self.transaction():
            return self.reclaimed

    def _end(self, db: sqlite3.Connection, pipeline: str, status: str, note: str | None) -> None:
        """A final status; the grant shrinks to what was spent, the rest goes back to the blocks."""
        db.execute(
            "UPDATE pipelines SET status = ?, note = COALESCE(?, note), lease_until = NULL "
            "WHERE id = ?",
            (status, note, pipeline),
        )
        db.execute(
            "UPDATE allocations SET epsilon = spent, delta = delta_spent "
            "WHERE pipeline = ? AND (epsilon > spent OR delta > delta_spent)",
            (pipeline,),
        )

    def claim(
        self,
        pipeline: Pipeline,
        holder: str,
        lease_s: float,
        *,
        delta: float = 0.0,
        resume: bool = False,
    ) -> PipelineRecord:
        """Submit `pipeline` under a lease held by `holder`, or (resume) take it over.

        Atomic: of several processes claiming one id at once exactly one wins. A fresh
        claim of an id the ledger knows is refused; so is any claim while another holder's
        lease is live. A resume after the lease lapsed takes back the pipeline's grant
        (κ·demand) if the blocks still have it, and is refused if they do not.
        """
        now = time.time()
        with self.transaction() as db:
            self._require_consistent()
            row = db.execute(
                "SELECT status, holder, lease_until FROM pipelines WHERE id = ?", (pipeline.id,)
            ).fetchone()
            if row is None and resume:
                raise LedgerError(
                    f"pipeline {pipeline.id!r} of the checkpoint is not in ledger {self.path}"
                )
            if row is None:
                self._insert(db, pipeline, delta, holder, now + lease_s)
            elif row[0] in LIVE:
                left = "for ever" if row[2] is None else f"for another {row[2] - now:.0f} s"
                raise LedgerError(
                    f"pipeline {pipeline.id!r} in {self.path} is held by a live run "
                    f"({row[1] or 'no lease'}, {row[0]}, lease {left}): a second claimant is "
                    "refused (if that run died, resume it once the lease has lapsed)"
                )
            elif not resume:
                raise LedgerError(
                    f"pipeline {pipeline.id!r} already exists in ledger {self.path} ({row[0]}); "
                    "choose another id (or none, for a fresh one), or resume from its checkpoint"
                )
            elif row[0] == "expired":
                self._regrant(db, pipeline.id, holder, now + lease_s)
        record = self.pipeline(pipeline.id)
        assert record is not None
        return record

    def _regrant(self, db: sqlite3.Connection, pipeline: str, holder: str, until: float) -> None:
        """Take back an expired pipeline's κ·demand on every block, if it still fits."""
        try:
            db.execute(
                "UPDATE allocations SET "
                "epsilon = (SELECT p.kappa * d.epsilon FROM pipelines p JOIN demands d "
                "ON d.pipeline = p.id WHERE p.id = allocations.pipeline "
                "AND d.block = allocations.block), "
                "delta = (SELECT d.delta FROM demands d WHERE d.pipeline = allocations.pipeline "
                "AND d.block = allocations.block) WHERE pipeline = ?",
                (pipeline,),
            )
        except sqlite3.IntegrityError as err:
            raise BudgetExceeded(
                f"pipeline {pipeline!r}'s lease lapsed and its unspent grant was given to other "
                "pipelines: it cannot resume; start a new run"
            ) from err
        db.execute(
            "UPDATE pipelines SET status = 'granted', holder = ?, lease_until = ?, note = NULL "
            "WHERE id = ?",
            (holder, until, pipeline),
        )

    def heartbeat(self, pipeline: str, holder: str, lease_s: float) -> None:
        """Renew `holder`'s lease on a live pipeline; LeaseLost if it no longer holds it."""
        with self.transaction() as db:
            self._renew(db, pipeline, holder, lease_s)

    def _renew(self, db: sqlite3.Connection, pipeline: str, holder: str, lease_s: float) -> None:
        renewed = db.execute(
            "UPDATE pipelines SET lease_until = ? "
            "WHERE id = ? AND holder = ? AND status IN ('waiting', 'granted')",
            (time.time() + lease_s, pipeline, holder),
        ).rowcount
        if not renewed:
            row = db.execute(
                "SELECT status, holder, note FROM pipelines WHERE id = ?", (pipeline,)
            ).fetchone()
            why = "unknown" if row is None else f"{row[0]}, held by {row[1]}: {row[2] or '-'}"
            raise LeaseLost(f"pipeline {pipeline!r} lost its lease in {self.path} ({why})")

    # ----- blocks and pipelines -----------------------------------------------------------
    def add_blocks(
        self, budgets: Mapping[str, float], *, delta: float = 1.0, now: float | None = None
    ) -> int:
        """Create the blocks that do not exist yet, ε budgets as given and a δ budget each.

        Existing budgets are kept. Returns how many blocks were created.
        """
        created = time.time() if now is None else now
        with self.transaction() as db:
            before = db.total_changes
            db.executemany(
                "INSERT OR IGNORE INTO blocks (id, budget, delta_budget, created) "
                "VALUES (?, ?, ?, ?)",
                [(b, float(e), float(delta), created) for b, e in budgets.items()],
            )
            return db.total_changes - before

    def submit(self, pipeline: Pipeline, *, delta: float = 0.0) -> None:
        """Register a waiting pipeline without a lease, demanding δ on every demanded block."""
        with self.transaction() as db:
            self._insert(db, pipeline, delta, None, None)

    def _insert(
        self,
        db: sqlite3.Connection,
        pipeline: Pipeline,
        delta: float,
        holder: str | None,
        until: float | None,
    ) -> None:
        try:
            db.execute(
                "INSERT INTO pipelines (id, analyst, status, arrival, loss, holder, lease_until) "
                "VALUES (?, ?, 'waiting', ?, ?, ?, ?)",
                (pipeline.id, pipeline.analyst, pipeline.arrival, pipeline.loss, holder, until),
            )
            db.executemany(
                "INSERT INTO demands (pipeline, block, epsilon, delta) VALUES (?, ?, ?, ?)",
                [(pipeline.id, b, float(e), float(delta)) for b, e in pipeline.demand.items()],
            )
        except sqlite3.IntegrityError as err:
            raise LedgerError(f"cannot submit pipeline {pipeline.id!r}: {err}") from err
        db.executemany(
            "UPDATE blocks SET arrivals = arrivals + 1 WHERE id = ?",
            [(b,) for b in pipeline.demand],
        )

    def set_status(
        self, pipeline: str, status: str, note: str | None = None, *, holder: str | None = None
    ) -> None:
        """End a pipeline: a granted one finished, stopped or released, a waiting one cancelled.

        Its grant shrinks to what it spent, in the same transaction: the unspent rest of
        each block's ε and δ goes back to the block. With `holder`, only that holder may.
        """
        if status not in ENDS:
            raise LedgerError(f"status must be one of {', '.join(ENDS)}, not {status!r}")
        with self.transaction() as db:
            row = db.execute(
                "SELECT status, holder FROM pipelines WHERE id = ?", (pipeline,)
            ).fetchone()
            if row is None:
                raise LedgerError(f"no pipeline {pipeline!r} in {self.path}")
            if row[0] != ENDS[status]:
                raise LedgerError(
                    f"pipeline {pipeline!r} is {row[0]}, not {ENDS[status]}: it cannot be {status}"
                )
            if holder is not None and row[1] != holder:
                raise LeaseLost(f"pipeline {pipeline!r} is held by {row[1]}, not {holder}")
            self._end(db, pipeline, status, note)

    # ----- scheduling ---------------------------------------------------------------------
    def problem(self, now: float) -> Problem:
        """The current scheduling problem: all blocks and the waiting pipelines whose δ fits."""
        blocks, delta_free = {}, {}
        for b, budget, allocated, arrivals, d_budget, d_allocated in self.db.execute(
            "SELECT id, budget, allocated, arrivals, delta_budget, delta_allocated FROM blocks"
        ):
            blocks[b] = Block(b, budget, max(budget - allocated, 0.0), arrivals)
            delta_free[b] = d_budget * ROOM + DSLACK - d_allocated
        demand: dict[str, dict[str, float]] = {}
        misfits = set()
        for pipeline, block, epsilon, delta in self.db.execute(
            "SELECT d.pipeline, d.block, d.epsilon, d.delta FROM demands d "
            "JOIN pipelines p ON p.id = d.pipeline WHERE p.status = 'waiting'"
        ):
            demand.setdefault(pipeline, {})[block] = epsilon
            if delta > delta_free[block]:
                misfits.add(pipeline)
        pipelines = [
            Pipeline(pid, analyst, demand.get(pid, {}), arrival, loss)
            for pid, analyst, arrival, loss in self.db.execute(
                "SELECT id, analyst, arrival, loss FROM pipelines "
                "WHERE status = 'waiting' ORDER BY arrival, rowid"
            )
            if pid not in misfits
        ]
        return Problem(blocks, pipelines, now)

    def allocate(
        self, grants: Sequence[Grant], *, before_commit: Callable[[], None] | None = None
    ) -> None:
        """Record grants of waiting pipelines, all or none, in one transaction.

        `before_commit` runs inside the open transaction (crash tests kill the process there).
        """
        with self.transaction() as db:
            self._require_consistent()
            self._write_grants(db, grants)
            if before_commit is not None:
                before_commit()

    def schedule(
        self,
        scheduler: Scheduler,
        now: float | None = None,
        *,
        cancel_if_waiting: str | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> list[Grant]:
        """One scheduling round: read, decide and record under one write lock.

        Grants whose δ no longer fits after this round's earlier grants are left out (the
        schedulers see ε only). `cancel_if_waiting` names a pipeline that cannot wait: if
        this round does not grant it, it is cancelled in the same transaction.
        """
        with self.transaction() as db:
            self._require_consistent()
            grants = scheduler.allocate(self.problem(time.time() if now is None else now))
            grants = self._delta_fits(db, grants)
            self._write_grants(db, grants)
            if cancel_if_waiting is not None and db.execute(
                "SELECT status FROM pipelines WHERE id = ?", (cancel_if_waiting,)
            ).fetchone() == ("waiting",):
                note = f"not granted by the {scheduler.name} scheduler when it asked (too little "
                self._end(db, cancel_if_waiting, "cancelled", note + "budget left for its demand)")
            if before_commit is not None:
                before_commit()
        return grants

    def _delta_fits(self, db: sqlite3.Connection, grants: Sequence[Grant]) -> list[Grant]:
        """The grants, in order, whose δ demand fits what the earlier ones left."""
        free = {
            b: budget * ROOM + DSLACK - allocated
            for b, budget, allocated in db.execute(
                "SELECT id, delta_budget, delta_allocated FROM blocks"
            )
        }
        kept = []
        for grant in grants:
            need = dict(
                db.execute(
                    "SELECT block, delta FROM demands WHERE pipeline = ?", (grant.pipeline,)
                ).fetchall()
            )
            if all(d <= free.get(b, 0.0) for b, d in need.items()):
                for b, d in need.items():
                    free[b] -= d
                kept.append(grant)
        return kept

    def _write_grants(self, db: sqlite3.Connection, grants: Sequence[Grant]) -> None:
        for grant in grants:
            row = db.execute(
                "SELECT status FROM pipelines WHERE id = ?", (grant.pipeline,)
            ).fetchone()
            if row is None or row[0] != "waiting":
                raise LedgerError(f"pipeline {grant.pipeline!r} is not waiting for a grant")
            delta = dict(
                db.execute(
                    "SELECT block, delta FROM demands WHERE pipeline = ?", (grant.pipeline,)
                ).fetchall()
            )
            try:
                db.executemany(
                    "INSERT INTO allocations (pipeline, block, epsilon, delta) VALUES (?, ?, ?, ?)",
                    [
                        (grant.pipeline, b, float(e), delta.get(b, 0.0))
                        for b, e in grant.epsilon.items()
                    ],
                )
            except sqlite3.IntegrityError as err:
                reason = self._overfull(db, grant, delta)
                raise BudgetExceeded(
                    f"grant of pipeline {grant.pipeline!r} does not fit: {reason}"
                ) from err
            db.execute(
                "UPDATE pipelines SET status = 'granted', kappa = ? WHERE id = ?",
                (grant.kappa, grant.pipeline),
            )

    def _overfull(self, db: sqlite3.Connection, grant: Grant, delta: Mapping[str, float]) -> str:
        for block, epsilon in grant.epsilon.items():
            row = db.execute(
                "SELECT budget, allocated, delta_budget, delta_allocated FROM blocks WHERE id = ?",
                (block,),
            ).fetchone()
            if row is None:
                return f"no block {block!r}"
            if row[1] + epsilon > row[0] + SLACK:
                return (
                    f"block {block!r} has {row[0] - row[1]:.6g} of {row[0]:.6g} left, "
                    f"asked {epsilon:.6g}"
                )
            if row[3] + delta.get(block, 0.0) > row[2] * ROOM + DSLACK:
                return (
                    f"block {block!r} has δ {row[2] - row[3]:.3g} of {row[2]:.3g} left, "
                    f"asked {delta.get(block, 0.0):.3g}"
                )
        return "constraint failed"

    # ----- spending -----------------------------------------------------------------------
    def charge(
        self,
        pipeline: str,
        round_: int,
        spend: Mapping[str, float],
        *,
        delta: Mapping[str, float] | None = None,
        holder: str | None = None,
        lease_s: float | None = None,
    ) -> bool:
        """Charge one round's (ε, δ) spend per block against the pipeline's grant, all or none.

        Idempotent per (pipeline, block, round): a round re-run after a crash is charged
        once. Returns False when the round had already been charged. Raises BudgetExceeded
        (and charges nothing) when any block would go past the grant. With `holder` and
        `lease_s` it is also the holder's heartbeat: LeaseLost if it no longer holds it.
        """
        delta = delta or {}
        with self.transaction() as db:
            if holder is not None and lease_s is not None:
                self._renew(db, pipeline, holder, lease_s)
            row = db.execute("SELECT status FROM pipelines WHERE id = ?", (pipeline,)).fetchone()
            if row is None or row[0] != "granted":
                state = "unknown" if row is None else row[0]
                raise LedgerError(f"pipeline {pipeline!r} is {state}, not granted: nothing charged")
            charged = 0
            for block, epsilon in spend.items():
                if db.execute(
                    "SELECT 1 FROM charges WHERE pipeline = ? AND block = ? AND round = ?",
                    (pipeline, block, round_),
                ).fetchone():
                    continue
                grant = db.execute(
                    "SELECT epsilon, spent, delta, delta_spent FROM allocations "
                    "WHERE pipeline = ? AND block = ?",
                    (pipeline, block),
                ).fetchone()
                if grant is None:
                    raise BudgetExceeded(f"pipeline {pipeline!r} has no grant on block {block!r}")
                d = float(delta.get(block, 0.0))
                try:
                    db.execute(
                        "INSERT INTO charges (pipeline, block, round, epsilon, delta) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (pipeline, block, round_, float(epsilon), d),
                    )
                except sqlite3.IntegrityError as err:
                    over = (
                        f"ε={grant[1] + epsilon:.6g} on block {block!r} in round {round_}, "
                        f"above its grant of {grant[0]:.6g}"
                        if grant[1] + epsilon > grant[0] + SLACK
                        else f"δ={grant[3] + d:.3g} on block {block!r} in round {round_}, "
                        f"above its δ grant of {grant[2]:.3g}"
                    )
                    raise BudgetExceeded(f"pipeline {pipeline!r} would spend {over}") from err
                charged += 1
            return charged > 0

    # ----- reading and auditing -----------------------------------------------------------
    def pipeline(self, pipeline: str) -> PipelineRecord | None:
        """A pipeline's state, or None if the ledger does not know it."""
        row = self.db.execute(
            "SELECT analyst, status, kappa, note, holder, lease_until FROM pipelines WHERE id = ?",
            (pipeline,),
        ).fetchone()
        if row is None:
            return None
        rows = self.db.execute(
            "SELECT block, epsilon, spent, delta, delta_spent FROM allocations WHERE pipeline = ?",
            (pipeline,),
        ).fetchall()
        return PipelineRecord(
            pipeline,
            row[0],
            row[1],
            row[2],
            {r[0]: r[1] for r in rows},
            {r[0]: r[2] for r in rows},
            row[3],
            {r[0]: r[3] for r in rows},
            {r[0]: r[4] for r in rows},
            row[4],
            row[5],
        )

    def blocks(self) -> dict[str, tuple[float, float]]:
        """(budget, allocated) ε of every block."""
        return {
            b: (budget, allocated)
            for b, budget, allocated in self.db.execute("SELECT id, budget, allocated FROM blocks")
        }

    def delta_blocks(self) -> dict[str, tuple[float, float]]:
        """(budget, allocated) δ of every block."""
        return {
            b: (budget, allocated)
            for b, budget, allocated in self.db.execute(
                "SELECT id, delta_budget, delta_allocated FROM blocks"
            )
        }

    def _require_consistent(self) -> None:
        problems = self.check()
        if problems:
            more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
            raise LedgerInconsistent(
                f"ledger {self.path} is inconsistent ({problems[0]}{more}): refusing to grant; "
                f"inspect it with `python -m privacy.cli ledger {self.path}`"
            )

    def check(self) -> list[str]:
        """Every violated invariant, in words; empty when the ledger is consistent."""
        return check_invariants(self.db)
