"""The ledger never loses or double-spends budget: real processes racing, leases, kill -9, δ."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import python_run
from omegaconf import DictConfig

from fl.common.config import compose
from privacy.dpbalance import FCFS, DPBalance, Pipeline
from privacy.dpsgd import DPSGD
from privacy.ledger import BudgetExceeded, LeaseLost, Ledger, LedgerError, new_holder
from privacy.rounds import RoundPrivacy

RUN = ["experiment=dpbalance", "num_clients=4", "clients_per_round=2", "rounds=6"]
BLOCKS = [f"digits/client-{p}" for p in range(4)]
FORK = multiprocessing.get_context("fork")  # children start at once, with torch already loaded
TASK = SimpleNamespace(sizes=np.full(4, 64))  # all RoundPrivacy reads of a task


def _config(ledger: Path, *extra: str) -> DictConfig:
    """A 4-client DPBalance run on `ledger`; σ = 3 fixed (ε ≈ 0.87 a round), not sized by Opacus."""
    fixed = ["privacy.ledger.noise_from_grant=false", "privacy.noise_multiplier=3.0"]
    cfg = compose([*RUN, f"privacy.ledger.path={ledger}", *fixed, *extra])
    dp = DPSGD.from_config(cfg)
    assert dp is not None
    dp.projected_epsilon(dp.plan(64), 1)  # warm the accountant's cache: leases time silence only
    return cfg


def _privacy(ledger: Path, out_dir: Path, *extra: str) -> RoundPrivacy:
    """The server's privacy bookkeeping of a run, in this process."""
    return RoundPrivacy(_config(ledger, *extra), TASK, out_dir)


def _serve(cfg: DictConfig, out_dir: Path, go: Any, reports: Any, done: Any) -> None:
    """A run's server in a child: start and charge round 1 when all are ready, report, hold."""
    privacy = RoundPrivacy(cfg, TASK, out_dir)
    go.wait()
    stop = privacy.start() or privacy.admit(1, [0, 1])
    reports.put({"stop": stop, "state": privacy.state_dict()})
    done.wait()
    privacy.finish()


def _servers(cfg: DictConfig, out_dir: Path, n: int) -> tuple[list[Any], list[dict], Any]:
    """`n` run servers racing on one ledger; the processes, their reports, and `done`."""
    go, reports, done = FORK.Barrier(n), FORK.Queue(), FORK.Event()
    procs = [
        FORK.Process(target=_serve, args=(cfg, out_dir, go, reports, done), daemon=True)
        for _ in range(n)
    ]
    for proc in procs:
        proc.start()
    return procs, [reports.get(timeout=120) for _ in procs], done


def _join(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0


def _open_and_submit(path: Path, worker: int, go: Any) -> None:
    go.wait()
    with Ledger(path) as ledger:
        ledger.add_blocks({"B": 1.0})
        ledger.submit(Pipeline(f"P{worker}", "a", {"B": 0.1}))


def _hold_write_lock(path: Path, locked: Any) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")  # what a first opener holds while it switches to WAL
    locked.set()
    time.sleep(1.0)
    db.execute("COMMIT")


def test_concurrent_first_opens_of_a_new_ledger_all_succeed(tmp_path):
    # switching a new file to WAL needs its write lock, and SQLite does not wait for it
    # there: while one first opener held it, every other one failed at once
    path, go, locked = tmp_path / "new.sqlite", FORK.Barrier(7), FORK.Event()
    holder = FORK.Process(target=_hold_write_lock, args=(path, locked), daemon=True)
    holder.start()
    assert locked.wait(timeout=30)
    openers = [
        FORK.Process(target=_open_and_submit, args=(path, w, go), daemon=True) for w in range(6)
    ]
    for proc in openers:
        proc.start()
    go.wait()
    _join([holder, *openers])
    with Ledger(path) as ledger:
        assert ledger.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert ledger.check() == []
        assert ledger.db.execute("SELECT COUNT(*) FROM pipelines").fetchone()[0] == 6


def test_racing_starts_under_one_pipeline_id_grant_it_once(tmp_path):
    cfg = _config(tmp_path / "ledger.sqlite", "privacy.ledger.pipeline=job")
    procs, reports, done = _servers(cfg, tmp_path, 4)
    refused = [r["stop"] for r in reports if r["stop"] is not None]
    assert len(refused) == 3  # one run trains, and only it
    assert all("'job'" in s and "held by a live run" in s and "\n" not in s for s in refused)
    done.set()
    _join(procs)
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.check() == []
        record = ledger.pipeline("job")
        assert record.status == "finished" and record.lease_until is None
        assert record.spent == pytest.approx(record.granted)  # finished: the rest went back
        assert record.spent[BLOCKS[0]] > 0 and record.spent[BLOCKS[2]] == 0
        charges = ledger.db.execute("SELECT COUNT(*) FROM charges").fetchone()[0]
        assert charges == 2  # round 1, the 2 selected clients, charged once


def test_a_refused_pipeline_is_cancelled_and_never_granted_later(tmp_path):
    ledger_path = tmp_path / "ledger.sqlite"
    first = _privacy(ledger_path, tmp_path / "a")
    assert first.start() is None  # κ = 1.25: 2.5 of each block's 5.0
    # a run in another process demands 3.0 where 2.5 is left: refused
    cfg = _config(ledger_path, "privacy.ledger.demand_epsilon=3.0")
    procs, (report,), done = _servers(cfg, tmp_path / "b", 1)
    done.set()
    _join(procs)
    assert "is cancelled: not granted by the dpbalance scheduler" in report["stop"]
    assert report["state"]["pipeline"].startswith("b-")  # a fresh id: run dir name + uuid4
    assert _privacy(ledger_path, tmp_path / "b").pipeline != report["state"]["pipeline"]
    first.finish()  # 2.5 goes back to every block: now the 3.0 would fit
    with Ledger(ledger_path) as ledger:
        assert ledger.schedule(DPBalance(beta=2.2)) == []  # but nobody waits for it
        record = ledger.pipeline(report["state"]["pipeline"])
        assert record.status == "cancelled" and record.granted == {}
        assert all(allocated == 0 for _, allocated in ledger.blocks().values())
        assert ledger.check() == []


def test_a_killed_run_gives_its_grant_back_when_its_lease_lapses(tmp_path):
    ledger_path, pipeline = tmp_path / "ledger.sqlite", "killed"
    fresh = _config(ledger_path, f"privacy.ledger.pipeline={pipeline}")  # composed ahead:
    resume = _config(ledger_path, "resume=true")  # the checks below must beat the lease
    lease = _config(ledger_path, f"privacy.ledger.pipeline={pipeline}", "privacy.ledger.lease_s=4")
    procs, (report,), _ = _servers(lease, tmp_path, 1)
    assert report["stop"] is None and report["state"]["pipeline"] == pipeline
    os.kill(procs[0].pid, signal.SIGKILL)  # after round 1's charge, before any checkpoint
    procs[0].join(timeout=30)

    # the grant is still leased: neither a fresh run nor a resume may take it over
    assert "held by a live run" in RoundPrivacy(fresh, TASK, tmp_path / "b").start()
    resumed = RoundPrivacy(resume, TASK, tmp_path)
    resumed.load_state_dict(report["state"])  # the checkpoint names the pipeline
    assert "held by a live run" in resumed.start()

    with Ledger(ledger_path) as ledger:
        record = ledger.pipeline(pipeline)
        assert record.status == "granted" and record.granted[BLOCKS[0]] == pytest.approx(2.5)
        time.sleep(max(record.lease_until - time.time(), 0) + 0.05)
        assert ledger.reclaim() == [pipeline]  # the lease lapsed: the next write takes it back
        record = ledger.pipeline(pipeline)
        assert record.status == "expired" and "lease lapsed" in record.note
        assert record.granted == record.spent and record.spent[BLOCKS[0]] > 0
        assert {b: a for b, (_, a) in ledger.blocks().items()} == pytest.approx(record.spent)
        assert ledger.check() == []

    # a resume after the lapse takes its grant back, as the blocks still have it
    resumed = RoundPrivacy(resume, TASK, tmp_path)
    resumed.load_state_dict(report["state"])
    assert resumed.start() is None and resumed.pipeline == pipeline
    assert resumed.admit(2, [0, 1]) is None
    resumed.finish()
    with Ledger(ledger_path) as ledger:
        assert ledger.pipeline(pipeline).status == "finished" and ledger.check() == []
        assert [r for (r,) in ledger.db.execute("SELECT DISTINCT round FROM charges")] == [1, 2]


def test_a_resume_after_the_lapse_is_refused_once_others_took_the_budget(tmp_path):
    ledger_path = tmp_path / "ledger.sqlite"
    first = _privacy(ledger_path, tmp_path / "a", "privacy.ledger.lease_s=2")
    assert first.start() is None and first.admit(1, [0]) is None
    time.sleep(2.1)  # it went silent; another run's claim reclaims its grant and takes it
    other = _privacy(ledger_path, tmp_path / "b", "privacy.ledger.demand_epsilon=3.0")
    assert other.start() is None
    assert first.admit(2, [1]).startswith(f"privacy budget: pipeline {first.pipeline!r} lost")
    resumed = _privacy(ledger_path, tmp_path / "a", "resume=true")
    resumed.load_state_dict(first.state_dict())
    assert "it cannot resume" in resumed.start()
    with Ledger(ledger_path) as ledger:
        assert ledger.pipeline(first.pipeline).status == "expired"
        assert ledger.check() == []


def _tamper(path: Path) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE blocks SET allocated = 0")  # hides the grants: room for more


def test_no_grant_on_a_tampered_ledger(tmp_path):
    ledger_path = tmp_path / "ledger.sqlite"
    assert _privacy(ledger_path, tmp_path / "a").start() is None
    tamper = FORK.Process(target=_tamper, args=(ledger_path,), daemon=True)
    tamper.start()
    _join([tamper])
    second = _privacy(ledger_path, tmp_path / "b")
    stop = second.start()
    assert stop.startswith(f"privacy budget: ledger {ledger_path} is inconsistent (block ")
    assert "allocated 0.0 != sum of grants 2.5" in stop and "refusing to grant" in stop
    assert "\n" not in stop and second.grant == {}
    with Ledger(ledger_path) as ledger:
        assert ledger.pipeline(second.pipeline) is None
        with pytest.raises(LedgerError, match="is inconsistent"):
            ledger.schedule(FCFS())


def _claim_delta(path: Path, worker: int, go: Any, statuses: Any) -> None:
    with Ledger(path) as ledger:
        go.wait()
        ledger.claim(Pipeline(f"P{worker}", "a", {"B": 0.1}), new_holder(), 60, delta=1e-5)
        ledger.schedule(FCFS(), cancel_if_waiting=f"P{worker}")
        statuses.put(ledger.pipeline(f"P{worker}").status)


def test_delta_is_stored_composed_and_checked(tmp_path):
    path, go, statuses = tmp_path / "ledger.sqlite", FORK.Barrier(6), FORK.Queue()
    with Ledger(path) as ledger:
        ledger.add_blocks({"B": 1.0}, delta=3e-5)  # ε for ten pipelines, δ for three
    procs = [
        FORK.Process(target=_claim_delta, args=(path, w, go, statuses), daemon=True)
        for w in range(6)
    ]
    for proc in procs:
        proc.start()
    assert sorted(statuses.get(timeout=60) for _ in procs) == ["cancelled"] * 3 + ["granted"] * 3
    _join(procs)
    with Ledger(path) as ledger:
        assert ledger.delta_blocks()["B"] == pytest.approx((3e-5, 3e-5))
        (winner,) = ledger.db.execute(
            "SELECT id FROM pipelines WHERE status = 'granted' ORDER BY id LIMIT 1"
        ).fetchone()
        assert ledger.charge(winner, 1, {"B": 0.01}, delta={"B": 1e-5})
        with pytest.raises(BudgetExceeded, match=r"would spend δ=1\.1e-05 .* δ grant of 1e-05"):
            ledger.charge(winner, 2, {"B": 0.01}, delta={"B": 1e-6})
        ledger.set_status(winner, "finished")
        record = ledger.pipeline(winner)
        assert record.delta_granted == record.delta_spent == {"B": 1e-5}
        assert ledger.check() == []


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    return python_run([sys.executable, "-m", "privacy.cli", *map(str, args)], timeout=60)


def test_cli_refuses_a_missing_ledger_and_releases_and_cancels(tmp_path):
    missing = tmp_path / "nowhere" / "ledger.sqlite"
    out = _cli("ledger", missing)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.startswith(f"privacy.cli: error: no ledger at {missing} (")
    assert len(out.stderr.splitlines()) == 1 and not missing.parent.exists()

    path, holder = tmp_path / "ledger.sqlite", new_holder()
    with Ledger(path) as ledger:
        ledger.add_blocks({"B": 1.0})
        ledger.claim(Pipeline("held", "a", {"B": 0.5}), holder, 600)
        ledger.claim(Pipeline("queued", "a", {"B": 0.9}), new_holder(), 600)
        assert [g.pipeline for g in ledger.schedule(FCFS())] == ["held"]
        ledger.charge("held", 1, {"B": 0.1}, holder=holder, lease_s=600)
    out = _cli("release", path, "held")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "released pipeline 'held': ε 0.4 went back to 1 block(s)\n"
    out = _cli("cancel", path, "queued")
    assert out.returncode == 0 and out.stdout == "cancelled pipeline 'queued'\n", out.stderr
    with Ledger(path) as ledger:
        assert ledger.blocks()["B"] == pytest.approx((1.0, 0.1)) and ledger.check() == []
        with pytest.raises(LeaseLost, match="released"):  # its run stops at the next round
            ledger.heartbeat("held", holder, 600)
        with pytest.raises(LedgerError, match="'held' is released, not waiting"):
            ledger.set_status("held", "cancelled")


def _churn(path: Path, seed: int) -> None:
    """Claims, grants, charges and finishes, or goes silent and lets the lease lapse."""
    rng, holder = random.Random(seed), new_holder()
    with Ledger(path) as ledger:
        for j in range(10**9):
            pid = f"s{seed}p{j}"
            demand = {b: rng.uniform(0.05, 0.4) for b in rng.sample(["B0", "B1", "B2"], 2)}
            try:
                ledger.claim(Pipeline(pid, "a", demand, j), holder, 0.3, delta=1e-6)
                if not any(
                    g.pipeline == pid for g in ledger.schedule(DPBalance(), cancel_if_waiting=pid)
                ):
                    continue
                grant = ledger.pipeline(pid)
                for r in range(rng.randint(0, 3)):
                    spend = {b: e * rng.uniform(0.0, 0.4) for b, e in grant.granted.items()}
                    delta = {b: 1e-6 * (r == 0) for b in spend}
                    ledger.charge(pid, r, spend, delta=delta, holder=holder, lease_s=0.3)
                if rng.random() < 0.5:
                    ledger.set_status(pid, "finished", holder=holder)
            except LedgerError:
                pass


@pytest.mark.slow
def test_random_kill_9_of_leased_runs_loses_no_budget(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.add_blocks({f"B{k}": 2.0 for k in range(3)}, delta=1e-4)
    rng = random.Random(3)
    for attempt in range(6):
        procs = [
            FORK.Process(target=_churn, args=(path, 10 * attempt + w), daemon=True)
            for w in range(3)
        ]
        for proc in procs:
            proc.start()
        time.sleep(2.0 + rng.random())
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=30)
            assert proc.exitcode == -signal.SIGKILL
        with Ledger(path) as ledger:
            assert ledger.check() == []
    time.sleep(0.4)
    with Ledger(path) as ledger:
        ledger.reclaim()
        assert ledger.check() == []
        live = "SELECT COUNT(*) FROM pipelines WHERE status IN ('waiting', 'granted')"
        assert ledger.db.execute(live).fetchone()[0] == 0
        spent = dict(ledger.db.execute("SELECT block, SUM(spent) FROM allocations GROUP BY block"))
        for block, (_, allocated) in ledger.blocks().items():  # nothing held beyond the spend
            assert allocated == pytest.approx(spent.get(block, 0.0))
        assert ledger.db.execute("SELECT COUNT(*) FROM charges").fetchone()[0] > 10
