"""The SQLite budget ledger, for real: concurrent processes, kill -9 mid-transaction, invariants."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import forkrun
import pytest
from conftest import python_popen

from privacy.dpbalance import FCFS, DPBalance, Grant, Pipeline
from privacy.ledger import BudgetExceeded, Ledger, LedgerError


def _python(code: str, *args: str) -> forkrun.ForkedProcess | subprocess.Popen[str]:
    """A real child process running `code` (argv[1:] = args) from the repository root."""
    return python_popen([sys.executable, "-c", textwrap.dedent(code), *args], stream=True)


def test_grants_and_charges_keep_every_invariant(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        assert ledger.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert ledger.add_blocks({"B1": 1.0, "B2": 1.0}) == 2
        assert ledger.add_blocks({"B1": 9.0}) == 0  # an existing budget is never changed
        ledger.submit(Pipeline("P", "alice", {"B1": 0.5, "B2": 0.3}))
        ledger.submit(Pipeline("Q", "bob", {"B1": 0.6}))
        with pytest.raises(LedgerError, match="FOREIGN KEY"):
            ledger.submit(Pipeline("R", "bob", {"nope": 0.1}))
        ledger.allocate([Grant("P", 1.0, {"B1": 0.5, "B2": 0.3})])
        with pytest.raises(BudgetExceeded, match=re.escape("'B1' has 0.5 of 1 left, asked 0.6")):
            ledger.allocate([Grant("Q", 1.0, {"B1": 0.6})])
        assert ledger.pipeline("Q").status == "waiting"  # the refused grant left no trace
        with pytest.raises(LedgerError, match="not waiting"):
            ledger.allocate([Grant("P", 1.0, {"B1": 0.1})])

        assert ledger.charge("P", 1, {"B1": 0.2, "B2": 0.1}) is True
        assert ledger.charge("P", 1, {"B1": 0.2, "B2": 0.1}) is False  # idempotent per round
        with pytest.raises(
            BudgetExceeded, match=re.escape("would spend ε=0.6 on block 'B1' in round 2")
        ):
            ledger.charge("P", 2, {"B2": 0.1, "B1": 0.4})
        assert ledger.pipeline("P").spent == pytest.approx({"B1": 0.2, "B2": 0.1})  # all or none

        ledger.set_status("P", "finished")  # the unspent grant returns to the blocks
        assert {b: a for b, (_, a) in ledger.blocks().items()} == pytest.approx(
            {"B1": 0.2, "B2": 0.1}
        )
        ledger.allocate([Grant("Q", 1.0, {"B1": 0.6})])
        assert ledger.check() == []


def test_the_database_itself_refuses_an_over_allocation(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        ledger.add_blocks({"B": 1.0})
        ledger.submit(Pipeline("P", "a", {"B": 0.7}))
        ledger.submit(Pipeline("Q", "a", {"B": 0.7}))
        ledger.db.execute("INSERT INTO allocations (pipeline, block, epsilon) VALUES ('P','B',0.7)")
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):  # bypassing our code
            ledger.db.execute(
                "INSERT INTO allocations (pipeline, block, epsilon) VALUES ('Q','B',0.7)"
            )
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            ledger.db.execute("UPDATE blocks SET allocated = 2.0 WHERE id = 'B'")


CONTENDER = """
    import random, sys, time
    from pathlib import Path
    from privacy.dpbalance import DPBalance, FCFS, Pipeline
    from privacy.ledger import Ledger

    path, worker, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    rng = random.Random(worker)
    ledger = Ledger(path)
    scheduler = FCFS() if worker % 2 else DPBalance(beta=2.2)
    while not go.exists():
        time.sleep(0.005)
    granted = 0
    for j in range(20):
        blocks = rng.sample([f"B{k}" for k in range(4)], 2)
        ledger.submit(Pipeline(f"w{worker}p{j}", f"a{worker}", {b: 0.1 for b in blocks}, j))
        granted += len(ledger.schedule(scheduler, now=float(j)))
    print(granted)
"""


def test_concurrent_submitters_in_separate_processes_never_overspend(tmp_path):
    path, go = tmp_path / "ledger.sqlite", tmp_path / "go"
    with Ledger(path) as ledger:
        ledger.add_blocks({f"B{k}": 1.0 for k in range(4)})
    workers = [_python(CONTENDER, str(path), str(w), str(go)) for w in range(6)]
    time.sleep(1.0)  # let every worker import and open the ledger, then start them together
    go.touch()
    outputs = [w.communicate(timeout=120) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err[-2000:] for _, err in outputs]
    with Ledger(path) as ledger:
        assert ledger.check() == []
        (submitted,) = ledger.db.execute("SELECT COUNT(*) FROM pipelines").fetchone()
        assert submitted == 120  # no write was lost
        (grants,) = ledger.db.execute("SELECT COUNT(DISTINCT pipeline) FROM allocations").fetchone()
        assert grants == sum(int(out) for out, _ in outputs)  # every grant a worker saw is recorded
        # 120 pipelines x 0.2 demand against 4 blocks of 1.0: budgets run out, never over.
        # How far they run out depends on the interleaving; that nothing left fits does not.
        ledger.schedule(FCFS(), now=99.0)
        blocks = ledger.blocks()
        assert all(allocated <= budget + 1e-9 for budget, allocated in blocks.values())
        left = {b: budget - allocated for b, (budget, allocated) in blocks.items()}
        waiting = ledger.problem(now=99.0).pipelines
        assert waiting, "120 x 0.2 > 4 blocks of 1.0: some pipelines must still wait"
        assert all(any(e > left[b] + 1e-9 for b, e in p.demand.items()) for p in waiting)


HOLDER = """
    import sys, time
    from privacy.dpbalance import Grant
    from privacy.ledger import Ledger

    def hold():
        print("inside", flush=True)
        time.sleep(120)

    ledger = Ledger(sys.argv[1])
    ledger.allocate([Grant("P", 1.0, {"B1": 0.6, "B2": 0.6})], before_commit=hold)
"""


def test_a_process_killed_inside_an_allocation_leaves_no_trace(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.add_blocks({"B1": 1.0, "B2": 1.0})
        ledger.submit(Pipeline("P", "a", {"B1": 0.6, "B2": 0.6}))
        ledger.submit(Pipeline("Q", "b", {"B1": 0.5}))
    holder = _python(HOLDER, str(path))
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "inside"  # rows written, not committed
    with Ledger(path, timeout_s=0.2) as ledger:
        assert ledger.blocks()["B1"] == (1.0, 0.0)  # readers never see the open transaction
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            ledger.allocate([Grant("Q", 1.0, {"B1": 0.5})])
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    with Ledger(path) as ledger:
        assert ledger.check() == []
        assert ledger.blocks() == {"B1": (1.0, 0.0), "B2": (1.0, 0.0)}
        assert ledger.pipeline("P").status == "waiting" and ledger.pipeline("P").granted == {}
        ledger.allocate([Grant("Q", 1.0, {"B1": 0.5})])  # the lock died with the process
        assert ledger.blocks()["B1"] == (1.0, 0.5)


CHURN = """
    import random, sys
    from privacy.dpbalance import DPBalance, Pipeline
    from privacy.ledger import Ledger

    ledger = Ledger(sys.argv[1])
    rng = random.Random(int(sys.argv[2]))
    scheduler = DPBalance(beta=2.2)
    for j in range(10**9):
        blocks = rng.sample([f"B{k}" for k in range(5)], rng.randint(1, 3))
        pid = f"s{sys.argv[2]}p{j}"
        ledger.submit(Pipeline(pid, f"a{j % 3}", {b: rng.uniform(0.02, 0.3) for b in blocks}, j))
        for grant in ledger.schedule(scheduler, now=float(j)):
            spend = {b: e * rng.uniform(0.2, 1.2) for b, e in grant.epsilon.items()}
            try:
                ledger.charge(grant.pipeline, 1, spend)
            except Exception:
                pass
            ledger.set_status(grant.pipeline, "finished")
"""


@pytest.mark.slow
def test_random_kill_9_during_scheduling_never_corrupts_the_ledger(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.add_blocks({f"B{k}": 3.0 for k in range(5)})
    rng = __import__("random").Random(7)
    rows = []
    for attempt in range(8):
        churn = _python(CHURN, str(path), str(attempt))
        time.sleep(1.5 + rng.random())
        os.kill(churn.pid, signal.SIGKILL)
        churn.wait(timeout=30)
        assert churn.returncode == -signal.SIGKILL, churn.stderr.read() if churn.stderr else ""
        with Ledger(path) as ledger:
            assert ledger.check() == []
            assert all(a <= b + 1e-9 for b, a in ledger.blocks().values())
            rows.append(ledger.db.execute("SELECT COUNT(*) FROM pipelines").fetchone()[0])
    assert rows == sorted(rows) and rows[-1] > rows[0] > 0  # work went on between kills


def test_schedule_reads_and_writes_under_one_lock(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        ledger.add_blocks({"B1": 1.0, "B2": 1.0})
        for pid, analyst, demand in (
            ("P1", "alice", {"B1": 0.5, "B2": 0.3}),
            ("P2", "alice", {"B1": 0.3, "B2": 0.5}),
            ("P3", "bob", {"B1": 0.4, "B2": 0.3}),
            ("P4", "bob", {"B1": 0.3, "B2": 0.3}),
        ):
            ledger.submit(Pipeline(pid, analyst, demand))
        grants = ledger.schedule(DPBalance(beta=2.2), now=0.0)
        assert sorted(g.pipeline for g in grants) == ["P1", "P3"]
        assert ledger.pipeline("P3").kappa == pytest.approx(1.25, rel=1e-6)
        assert [p.id for p in ledger.problem(0.0).pipelines] == ["P2", "P4"]
        assert ledger.check() == []


def test_a_file_that_is_not_a_ledger_of_this_version_is_refused(tmp_path):
    old = tmp_path / "old.sqlite"
    with sqlite3.connect(old) as db:  # a ledger from before leases and δ: no migration
        db.executescript("CREATE TABLE blocks (id TEXT PRIMARY KEY); PRAGMA user_version = 0;")
    with pytest.raises(
        LedgerError, match=r"old.sqlite is not a ledger of schema version 2 \(it has 0\)"
    ):
        Ledger(old)
    (tmp_path / "empty.sqlite").touch()
    with pytest.raises(LedgerError, match=r"empty.sqlite is not a ledger \(no tables\)"):
        Ledger(tmp_path / "empty.sqlite", create=False)
    with pytest.raises(LedgerError, match="no ledger at"):
        Ledger(tmp_path / "missing.sqlite", create=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.sqlite", "old.sqlite"]


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm", "-journal"])
def test_a_ledger_or_its_companion_that_is_a_link_is_refused_and_nothing_written_through(
    tmp_path, suffix
):
    """SQLite follows links: a link at the ledger's path, or at a file SQLite keeps beside it,
    would put the budget somewhere else. Refused in one line; the target stays untouched."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"")
    path = tmp_path / "budget.sqlite"
    if suffix:
        with Ledger(path) as ledger:  # a real ledger, then a link beside it
            ledger.add_blocks({"B": 1.0})
    (tmp_path / f"budget.sqlite{suffix}").unlink(missing_ok=True)
    (tmp_path / f"budget.sqlite{suffix}").symlink_to(elsewhere)
    for readonly in (False, True):
        with pytest.raises(LedgerError, match="symbolic link"):
            Ledger(path, readonly=readonly)
    assert elsewhere.read_bytes() == b""


def test_a_ledger_in_a_folder_that_is_a_link_is_refused(tmp_path):
    """A new ledger's folder is no link either: swapped for one, it would hold a fresh
    ledger with the whole budget unspent. Refused, and nothing is made in its target."""
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "ledgers").symlink_to(target, target_is_directory=True)
    with pytest.raises(LedgerError, match="is a symbolic link, not a directory"):
        Ledger(tmp_path / "ledgers" / "budget.sqlite")
    assert list(target.iterdir()) == []
    with Ledger(tmp_path / "real" / "budget.sqlite") as ledger:  # a plain new folder is made
        ledger.add_blocks({"B": 1.0})
