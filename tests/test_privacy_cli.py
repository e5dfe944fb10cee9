"""`python -m privacy.cli` with bad arguments, odd files and a tampered ledger: one line each,
never a traceback; the `ledger` inspection writes nothing."""

import hashlib
import sqlite3
import time
from pathlib import Path

import pytest

from privacy.cli import main
from privacy.dpbalance import Grant, Pipeline
from privacy.ledger import Ledger


def _refused(capsys, argv: list[str]) -> str:
    """The one error line of a refused command (exit 1, or argparse's 2)."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and err and "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--devices", "0"], "--devices: 0 is not an integer >= 1"),
        (["simulate", "--rounds", "0"], "--rounds: 0 is not an integer >= 1"),
        (["simulate", "--analysts", "0"], "--analysts: 0 is not an integer >= 1"),
        (["simulate", "--betas", "nan"], "--betas: nan is not a finite number > 0"),
        (["simulate", "--budget", "2", "1"], "--budget 2 1: the first must be <= the second"),
        (["simulate", "--name", "../..", "--out", "x"], "'../..' is not a plain file name stem"),
        (["simulate", "--out", "/proc/nope"], "No such file or directory: '/proc/nope'"),
        (["ledger", "/etc/passwd"], "/etc/passwd is not a readable ledger"),
        (["ledger", "/dev/null"], "/dev/null is a character device, not a regular file"),
    ],
)
def test_bad_arguments_and_odd_files_are_one_line(capsys, argv, message):
    assert message in _refused(capsys, argv)


def _ledger(path: Path) -> Path:
    """A ledger whose one granted pipeline's lease has lapsed, unreclaimed (its holder gone
    silent): the lease is a minute long while it is granted, so the grant never races the
    clock, and then set to have ended a second ago, as the clock would leave it."""
    with Ledger(path) as ledger:
        ledger.add_blocks({"B1": 1.0})
        ledger.claim(Pipeline("P", "alice", {"B1": 0.5}), "host:1", lease_s=60.0)
        ledger.allocate([Grant("P", 1.0, {"B1": 0.5})])
        note = "ok \x1b[31mred\x1b[0m \x07"  # what `cancel --note` or a tamperer may leave
        ledger.db.execute("UPDATE pipelines SET note = ? WHERE id = 'P'", (note,))
        ledger.db.execute("UPDATE pipelines SET lease_until = ? WHERE id = 'P'", (time.time() - 1,))
    return path


def test_the_ledger_inspection_writes_nothing_and_prints_no_escape_codes(tmp_path, capsys):
    path = _ledger(tmp_path / "l.sqlite")
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    assert main(["ledger", str(path)]) == 0
    out = capsys.readouterr().out
    assert "lease lapsed" in out and "consistent" in out  # shown, not reclaimed
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[31mred" in out
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    wal = path.with_name(path.name + "-wal")  # SQLite's reader files for a WAL ledger
    assert not wal.exists() or wal.stat().st_size == 0


@pytest.mark.parametrize(
    ("tamper", "problem"),
    [
        ("UPDATE allocations SET epsilon = 'nan'", "allocations.epsilon: 1 value(s)"),
        ("UPDATE blocks SET budget = 'x'", "blocks.budget: 1 value(s) that are not finite"),
        (
            "INSERT INTO allocations VALUES ('ghost', 'B1', 0.1, 0, 0, 0)",
            "allocations: 1 row(s) naming a pipeline that does not exist",
        ),
    ],
)
def test_a_tampered_ledger_is_reported_inconsistent_not_a_traceback(
    tmp_path, capsys, tamper, problem
):
    path = _ledger(tmp_path / "l.sqlite")
    db = sqlite3.connect(path)
    db.execute("PRAGMA foreign_keys = OFF")  # what the ledger's own connection enforces
    db.execute("PRAGMA ignore_check_constraints = ON")
    db.execute(tamper)
    db.commit()
    db.close()
    assert main(["ledger", str(path)]) == 1
    out = capsys.readouterr().out
    assert "INCONSISTENT" in out and problem in out
