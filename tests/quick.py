"""`make test-quick` (`pytest -m quick`): the tests that say in a few minutes whether the
project still works: its contracts, its smoke paths and one run of every strategy.

conftest marks every collected test whose node id is, or starts with, an entry below as
`quick` (a file, a test function with all its parameters, or one parameter). A slow test is
never marked. tests/test_quick_target.py checks that the selection is not empty, that every
entry still names a test, and that every registered strategy runs in it.
"""

from __future__ import annotations

QUICK = (
    # the contracts: module sizes, moved paths, layering, registered checks and apps
    "tests/test_architecture.py",
    # smoke paths: `make run`'s run and its outputs, a sweep with its comparison, a killed
    # run resumed, config errors in one line, a hand-written Flower app with our hooks
    "tests/test_run.py::test_run_writes_every_output",
    "tests/test_run.py::test_multirun_sweep_runs_every_combination",
    "tests/test_resume.py::test_killed_run_resumes_to_identical_metrics[apf]",
    "tests/test_config_errors.py::test_fl_run_exits_with_one_line",
    "tests/test_typos.py",
    "tests/test_flower_example.py::test_example_app_on_an_in_process_grid",
    # one test per strategy: every option of conf/strategy/ runs a few rounds in-process
    "tests/test_strategy_identity.py::"
    "test_a_strategy_with_its_defaults_is_not_fedavg_under_another_name",
    # this selection's own guard
    "tests/test_quick_target.py",
)
PER_STRATEGY = QUICK[-2]


def selects(nodeid: str, entry: str) -> bool:
    """Whether `entry` names the test `nodeid`: the whole id, or a prefix of it that ends
    where a file, a test function or a parameter list ends."""
    rest = nodeid[len(entry) :]
    return nodeid.startswith(entry) and (rest == "" or rest.startswith(("::", "[")))
