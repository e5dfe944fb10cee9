"""The ledger's tables, triggers and CHECK constraints, and the invariants of a consistent ledger.

`SCHEMA` creates a ledger of version `VERSION` in one script; its triggers keep each
block's `allocated` and each grant's `spent` current (ε and δ), and its CHECK constraints
abort any statement that would take them past the budget or the grant, within the float
tolerances `SLACK` (ε), `ROOM` and `DSLACK` (δ). `check_invariants` lists, in words,
every invariant an open ledger violates. `privacy.ledger` builds on this module.
"""

from __future__ import annotations

import re
import sqlite3

__all__ = [
    "DSLACK",
    "NUMBERS",
    "OBJECTS",
    "REFERENCES",
    "ROOM",
    "SCHEMA",
    "SLACK",
    "VERSION",
    "check_invariants",
]

SLACK = 1e-9  # float tolerance of the ε CHECKs (allocations are computed in float64)
DSLACK = 1e-18  # absolute float tolerance of the δ CHECKs (δ are ~1e-5, their sums round at ~1e-21)
ROOM = 1 + 1e-9  # relative float tolerance of the δ CHECKs
VERSION = 2  # PRAGMA user_version of the schema below (0: a ledger from before leases and δ)

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS blocks (
    id TEXT PRIMARY KEY,
    budget REAL NOT NULL CHECK (budget >= 0),
    allocated REAL NOT NULL DEFAULT 0,
    delta_budget REAL NOT NULL CHECK (delta_budget >= 0 AND delta_budget <= 1),
    delta_allocated REAL NOT NULL DEFAULT 0,
    arrivals INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    CHECK (allocated >= -{SLACK} AND allocated <= budget + {SLACK}),
    CHECK (delta_allocated >= -{DSLACK} AND delta_allocated <= delta_budget * {ROOM} + {DSLACK})
);
CREATE TABLE IF NOT EXISTS pipelines (
    id TEXT PRIMARY KEY,
    analyst TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN
        ('waiting', 'granted', 'finished', 'stopped', 'released', 'cancelled', 'expired')),
    arrival REAL NOT NULL,
    loss REAL NOT NULL DEFAULT 1.0,
    kappa REAL,
    holder TEXT,
    lease_until REAL,
    note TEXT
);
CREATE TABLE IF NOT EXISTS demands (
    pipeline TEXT NOT NULL REFERENCES pipelines(id),
    block TEXT NOT NULL REFERENCES blocks(id),
    epsilon REAL NOT NULL CHECK (epsilon > 0),
    delta REAL NOT NULL DEFAULT 0 CHECK (delta >= 0 AND delta <= 1),
    PRIMARY KEY (pipeline, block)
);
CREATE TABLE IF NOT EXISTS allocations (
    pipeline TEXT NOT NULL REFERENCES pipelines(id),
    block TEXT NOT NULL REFERENCES blocks(id),
    epsilon REAL NOT NULL CHECK (epsilon >= 0),
    spent REAL NOT NULL DEFAULT 0,
    delta REAL NOT NULL DEFAULT 0 CHECK (delta >= 0),
    delta_spent REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (pipeline, block),
    CHECK (spent >= 0 AND spent <= epsilon + {SLACK}),
    CHECK (delta_spent >= 0 AND delta_spent <= delta * {ROOM} + {DSLACK})
);
CREATE TABLE IF NOT EXISTS charges (
    pipeline TEXT NOT NULL,
    block TEXT NOT NULL,
    round INTEGER NOT NULL,
    epsilon REAL NOT NULL CHECK (epsilon >= 0),
    delta REAL NOT NULL DEFAULT 0 CHECK (delta >= 0),
    PRIMARY KEY (pipeline, block, round),
    FOREIGN KEY (pipeline, block) REFERENCES allocations(pipeline, block)
);
CREATE TRIGGER IF NOT EXISTS allocation_takes_budget AFTER INSERT ON allocations
BEGIN
    UPDATE blocks SET allocated = allocated + NEW.epsilon,
        delta_allocated = delta_allocated + NEW.delta WHERE id = NEW.block;
END;
CREATE TRIGGER IF NOT EXISTS allocation_returns_budget
AFTER UPDATE OF epsilon, delta ON allocations
BEGIN
    UPDATE blocks SET allocated = allocated - OLD.epsilon + NEW.epsilon,
        delta_allocated = delta_allocated - OLD.delta + NEW.delta WHERE id = NEW.block;
END;
CREATE TRIGGER IF NOT EXISTS charge_spends_grant AFTER INSERT ON charges
BEGIN
    UPDATE allocations SET spent = spent + NEW.epsilon, delta_spent = delta_spent + NEW.delta
    WHERE pipeline = NEW.pipeline AND block = NEW.block;
END;
PRAGMA user_version = {VERSION};
"""
OBJECTS = set(re.findall(r"CREATE (?:TABLE|TRIGGER) IF NOT EXISTS (\w+)", SCHEMA))


# every number column: a value of another SQLite type (text 'nan', a blob) is damage
NUMBERS = {
    "blocks": ("budget", "allocated", "delta_budget", "delta_allocated"),
    "pipelines": ("arrival", "loss"),
    "demands": ("epsilon", "delta"),
    "allocations": ("epsilon", "spent", "delta", "delta_spent"),
    "charges": ("epsilon", "delta"),
}
# rows that must name an existing pipeline or block (foreign keys hold only while enforced)
REFERENCES = (
    ("demands", "pipeline", "pipelines"),
    ("demands", "block", "blocks"),
    ("allocations", "pipeline", "pipelines"),
    ("allocations", "block", "blocks"),
)


def check_invariants(db: sqlite3.Connection) -> list[str]:
    """Every invariant the ledger open on `db` violates, in words; empty when it is consistent.

    Types and references first: the sums below are only meaningful over numbers."""
    problems = []
    names = {n for (n,) in db.execute("SELECT name FROM sqlite_master")}
    problems += [f"schema: {name} is missing" for name in sorted(OBJECTS - names)]
    if problems:
        return problems
    for table, columns in NUMBERS.items():
        for column in columns:
            (bad,) = db.execute(
                f"SELECT COUNT(*) FROM {table} WHERE typeof({column}) NOT IN ('real', 'integer')"
                f" OR {column} != {column} OR abs({column}) > 1e308"  # NaN, and ±inf
            ).fetchone()
            if bad:
                problems.append(f"{table}.{column}: {bad} value(s) that are not finite numbers")
    for table, column, target in REFERENCES:
        (orphans,) = db.execute(
            f"SELECT COUNT(*) FROM {table} t LEFT JOIN {target} x ON x.id = t.{column} "
            "WHERE x.id IS NULL"
        ).fetchone()
        if orphans:
            problems.append(f"{table}: {orphans} row(s) naming a {column} that does not exist")
    if problems:
        return problems
    for block, budget, allocated, total, d_budget, d_allocated, d_total in db.execute(
        "SELECT b.id, b.budget, b.allocated, COALESCE(SUM(a.epsilon), 0), b.delta_budget, "
        "b.delta_allocated, COALESCE(SUM(a.delta), 0) FROM blocks b "
        "LEFT JOIN allocations a ON a.block = b.id GROUP BY b.id"
    ):
        if abs(allocated - total) > SLACK:
            problems.append(f"block {block}: allocated {allocated} != sum of grants {total}")
        if total > budget + SLACK:
            problems.append(f"block {block}: grants {total} exceed budget {budget}")
        if abs(d_allocated - d_total) > DSLACK:
            problems.append(
                f"block {block}: δ allocated {d_allocated} != sum of δ grants {d_total}"
            )
        if d_total > d_budget * ROOM + DSLACK:
            problems.append(f"block {block}: δ grants {d_total} exceed δ budget {d_budget}")
    for pipeline, block, epsilon, spent, total, delta, d_spent, d_total in db.execute(
        "SELECT a.pipeline, a.block, a.epsilon, a.spent, COALESCE(SUM(c.epsilon), 0), "
        "a.delta, a.delta_spent, COALESCE(SUM(c.delta), 0) FROM allocations a "
        "LEFT JOIN charges c ON c.pipeline = a.pipeline AND c.block = a.block "
        "GROUP BY a.pipeline, a.block"
    ):
        if abs(spent - total) > SLACK:
            problems.append(f"{pipeline}@{block}: spent {spent} != sum of charges {total}")
        if total > epsilon + SLACK:
            problems.append(f"{pipeline}@{block}: charges {total} exceed grant {epsilon}")
        if abs(d_spent - d_total) > DSLACK:
            problems.append(f"{pipeline}@{block}: δ spent {d_spent} != sum of δ charges {d_total}")
        if d_total > delta * ROOM + DSLACK:
            problems.append(f"{pipeline}@{block}: δ charges {d_total} exceed δ grant {delta}")
    for pipeline, status, block, epsilon, delta, want, want_delta in db.execute(
        "SELECT p.id, p.status, a.block, a.epsilon, a.delta, "
        "CASE WHEN p.status = 'granted' THEN p.kappa * d.epsilon ELSE a.spent END, "
        "CASE WHEN p.status = 'granted' THEN d.delta ELSE a.delta_spent END "
        "FROM allocations a JOIN pipelines p ON p.id = a.pipeline "
        "LEFT JOIN demands d ON d.pipeline = a.pipeline AND d.block = a.block "
        "WHERE p.status != 'waiting'"
    ):  # a live grant is κ·demand (δ: the demand); an ended one shrank to its spend
        what = "κ·demand" if status == "granted" else "its spend"
        if want is None or abs(epsilon - want) > SLACK:
            problems.append(f"{pipeline}@{block}: {status}, grant {epsilon} != {what} {want}")
        if want_delta is None or abs(delta - want_delta) > DSLACK:
            problems.append(f"{pipeline}@{block}: {status}, δ grant {delta} != {what} {want_delta}")
    for (pipeline,) in db.execute(
        "SELECT p.id FROM pipelines p WHERE p.status = 'waiting' "
        "AND EXISTS (SELECT 1 FROM allocations a WHERE a.pipeline = p.id)"
    ):
        problems.append(f"{pipeline}: waiting but holds allocations")
    (integrity,) = db.execute("PRAGMA integrity_check").fetchone()
    if integrity != "ok":
        problems.append(f"integrity_check: {integrity}")
    return problems
