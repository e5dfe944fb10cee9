"""Typos on the command line: one line naming what the user wrote and the closest valid
spelling, never Hydra's advice to add the typo with `+`, and refused before torch loads."""

from __future__ import annotations

import sys

import pytest
from conftest import fl_run_cmd, python_run

from fl.common.config import ConfigError, compose
from fl.run.cli import _groups
from fl.run.override_keys import check_override_keys
from fl.run.validation import validate


def _refusal(*argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        check_override_keys(list(argv), _groups())
    message = str(info.value.code)
    assert "\n" not in message and "+" not in message  # one line; never "add it with +"
    return message


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["strategy=fedprox", "strategy.muu=0.1"],
            "fl-run: strategy.muu: strategy has no key 'muu' (with strategy=fedprox); "
            "did you mean strategy.mu?",
        ),
        (["task.hiddn=[32]"], "fl-run: task.hiddn: task has no key 'hiddn'"),
        (["lrr=0.1"], "fl-run: lrr: not in conf/config.yaml; did you mean lr?"),
        (
            ["strategy=flower", "+strategy.kwargs.server_momentum=0.9", "strategy.kwargs.srv=1"],
            "fl-run: strategy.kwargs.srv: strategy.kwargs has no key 'srv' (with strategy=flower)",
        ),
        # a sweep: every option of the swept group is a job, and fedavg has no mu
        (
            ["-m", "strategy=fedprox,fedavg", "strategy.mu=0.1"],
            "fl-run: strategy.mu: strategy has no key 'mu' (with strategy=fedavg)",
        ),
    ],
)
def test_a_key_typo_is_one_line_with_the_closest_key(argv, line):
    assert _refusal(*argv).startswith(line)


@pytest.mark.parametrize(
    "argv",
    [
        ["strategy=fedprox", "strategy.mu=0.1", "seed=3", "task.hidden=[32]"],
        ["strategy=flower", "+strategy.kwargs.server_momentum=0.9"],
        ["experiment=lbbsp_quick", "strategy.predictor=ema"],  # the preset's own strategy
        ["-m", "strategy=fedprox,fedprox", "strategy.mu=0.1"],
        ["+strategy.muu=0.1"],  # an addition: the strategy's own check judges it
        ["experiment/asfl_arm=fedavg"],  # a defaults-list entry, not a key: Hydra's to judge
    ],
)
def test_keys_that_exist_pass(argv):
    check_override_keys(argv, _groups())


def test_overrides_that_choose_no_group_option_compose_one_config(monkeypatch):
    """`rounds=3 plots=false lr=0.1 task.hidden=[8]` all look themselves up in one config:
    composed once (about 0.3 s each; it was once per key, 3 s of every run's start)."""
    import fl.run.override_keys as keys

    calls = []
    real = keys._compose
    monkeypatch.setattr(keys, "_compose", lambda o: calls.append(o) or real(o))
    argv = ["rounds=3", "plots=false", "lr=0.1", "task.hidden=[8]", "num_clients=4", "-m"]
    check_override_keys(argv, _groups())
    assert len(calls) == 1
    calls.clear()  # a key of a swept group: one config per option, each composed once
    check_override_keys(["strategy=fedprox,fedprox", "strategy.mu=0.1", "lr=0.2"], _groups())
    assert calls == [["strategy=fedprox"]]


def test_a_key_typo_end_to_end_is_one_line_without_hydras_advice(tmp_path):
    run_dir = tmp_path / "run"
    proc = python_run(fl_run_cmd(f"hydra.run.dir={run_dir}", "strategy=fedprox", "strategy.muu=1"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "fl-run: strategy.muu: strategy has no key 'muu' (with strategy=fedprox); "
        "did you mean strategy.mu?"
    ]
    assert "+strategy.muu" not in proc.stdout + proc.stderr and not run_dir.exists()


def test_an_unknown_option_gets_the_closest_one(tmp_path):
    proc = python_run(fl_run_cmd(f"hydra.run.dir={tmp_path / 'run'}", "strategy=fedavgg"))
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        "fl-run: strategy=fedavgg: no such option; did you mean strategy=fedavg? choices: "
    )


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["strategy=apf", "loop=semi_async"],
            "invalid config: loop='semi_async': strategy=apf needs every reply in the round "
            "it was asked for, and loop=semi_async lands replies late",
        ),
        (
            ["strategy=apf", "loop.late=carry"],
            "invalid config: loop.late='carry': strategy=apf needs every reply in the round "
            "it was asked for, and carried replies land late",
        ),
    ],
)
def test_a_loop_the_strategy_refuses_is_named_as_the_user_wrote_it(overrides, line):
    with pytest.raises(ConfigError) as info:
        validate(compose(overrides))
    assert str(info.value).startswith(line)
    if "loop=semi_async" in overrides:
        assert "late=carry" not in str(info.value)  # the loop's internal default, not written


def test_a_bad_value_is_refused_before_torch_is_imported():
    code = (
        "import sys\n"
        "sys.argv = ['fl-run', 'hydra.run.dir=/nonexistent/x', 'seed=abc']\n"
        "from fl.run.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exit:\n"
        "    print(exit.code)\n"
        "print('torch' in sys.modules, 'flwr' in sys.modules)\n"
    )
    proc = python_run([sys.executable, "-c", code], fresh=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == "fl-run: invalid config: seed='abc': must be an integer in [0, 4294967295]"
    assert lines[-1] == "False False", proc.stderr[-2000:]


_COUNTED_RUN = (
    "import os, sys\n"
    "import fl.run.override_keys as keys\n"
    "calls, real = [], keys._compose\n"
    "keys._compose = lambda overrides: calls.append(overrides) or real(overrides)\n"
    "from fl.run.cli import main\n"
    "sys.argv = ['fl-run', *sys.argv[1:]]\n"
    "try:\n"
    "    main()\n"
    "except SystemExit as exit:\n"
    "    print(exit.code)\n"
    "print('compositions', len(calls), os.environ.get('HYDRA_FULL_ERROR'))\n"
)


def test_a_command_line_hydra_accepts_is_not_composed_again_for_the_check():
    """The key check composes only once Hydra has refused the command line: a run Hydra
    accepts pays no extra composition (~0.1 CPU s), and Hydra's own error switch is left
    as the user had it."""
    argv = ["--cfg", "job", "rounds=3", "task.hidden=[8]", "strategy=fedprox", "strategy.mu=0.1"]
    proc = python_run([sys.executable, "-c", _COUNTED_RUN, *argv], timeout=120)
    assert "mu: 0.1" in proc.stdout, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "compositions 0 None"
    proc = python_run([sys.executable, "-c", _COUNTED_RUN, "strategy.muu=1"], timeout=120)
    assert proc.stdout.strip().splitlines()[-2:] == [
        "fl-run: strategy.muu: strategy has no key 'muu' (with strategy=fedavg); its keys: name",
        "compositions 1 None",
    ]


def test_a_refused_command_line_that_is_no_key_typo_reads_as_hydra_prints_it(tmp_path):
    proc = python_run(fl_run_cmd(f"hydra.run.dir={tmp_path / 'run'}", "rounds=[1"), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "no viable alternative at input '[1'"
    assert (
        lines[-1] == "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
    )
