"""`make test-quick` selects something, every entry of its list still names a test, and
every registered strategy runs in it: a rename cannot shrink it silently to nothing."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

import pytest
from conftest import python_run
from quick import PER_STRATEGY, QUICK, selects


@pytest.fixture(scope="module")
def selected() -> list[str]:
    """The node ids `pytest -m quick` runs (as `make test-quick` calls it), collected only.

    Only the files QUICK names are collected: conftest marks nothing else, so the selection
    is the whole suite's, in a third of the time.
    """
    files = sorted({entry.split("::")[0] for entry in QUICK})
    cmd = [sys.executable, "-m", "pytest", "-m", "quick", "--collect-only", "-q", "-n", "0", *files]
    proc = python_run([*cmd, "-p", "no:cacheprovider"], fresh=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("tests/")]


def test_the_selection_is_not_empty_and_every_entry_names_a_test(selected):
    assert len(selected) >= len(QUICK)
    unmatched = [entry for entry in QUICK if not any(selects(i, entry) for i in selected)]
    assert unmatched == [], "tests/quick.py names tests that no longer exist"


def test_every_registered_strategy_runs_in_the_selection(selected):
    names = sorted(ep.name for ep in entry_points(group="fl.strategies"))
    assert len(names) >= 16
    missing = [n for n in names if f"{PER_STRATEGY}[{n}]" not in selected]
    assert missing == []


def test_an_entry_selects_a_file_a_function_or_one_parameter_only():
    test = "tests/test_run.py::test_run_writes_every_output"
    assert selects(test, "tests/test_run.py") and selects(test, test)
    assert selects(f"{test}[a-b]", test) and not selects(f"{test}_again", test)
    assert not selects("tests/test_run.py::test_x", "tests/test_ru")
