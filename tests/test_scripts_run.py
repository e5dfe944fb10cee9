"""Every script under experiments/ and every example runs: `--help` for all of them (one
interpreter, so torch loads once), and a tiny real run of the APF stability probe."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, python_run

SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "experiments").glob("*.py"))
SCRIPTS += ["examples/apf_app/simulate.py"]
MODULES = ["examples.apf_app.app", "fl_example_plugin.fedavg_slr"]  # imported, not run

# Runs each script as __main__ with `--help` and each module by import; one JSON object.
HELP_ALL = """
import contextlib, importlib, io, json, runpy, sys
scripts, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.path.insert(0, "examples/strategy_plugin")
results = {}
for path in scripts:
    out, argv, syspath = io.StringIO(), sys.argv, list(sys.path)
    sys.argv, code = [path, "--help"], "returned without exiting"
    sys.path.insert(0, path.rpartition("/")[0])  # a script's own folder, as python puts it
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        code = done.code
    except BaseException as err:
        code = f"{type(err).__name__}: {err}"
    finally:
        sys.argv, sys.path[:] = argv, syspath
    results[path] = {"code": code, "output": out.getvalue()}
for name in modules:
    try:
        importlib.import_module(name)
        results[name] = {"code": 0, "output": ""}
    except BaseException as err:
        results[name] = {"code": f"{type(err).__name__}: {err}", "output": ""}
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def helped() -> dict[str, dict]:
    proc = python_run(
        [sys.executable, "-c", HELP_ALL, json.dumps(SCRIPTS), json.dumps(MODULES)], timeout=300
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULTS "))


def test_the_list_holds_every_script():
    assert len(SCRIPTS) > 20 and "experiments/apf_stability_probe.py" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS + MODULES)
def test_each_script_shows_its_help_and_each_module_imports(helped, name):
    result = helped[name]
    assert result["code"] == 0, result
    if name in SCRIPTS:
        out = result["output"]
        doc = (REPO / name).read_text()
        assert out.startswith("usage:") or out.split("\n", 1)[0] in doc  # argparse, or __doc__


def test_the_apf_stability_probe_runs_through_the_public_api(tmp_path):
    # experiments/README lists it; it broke when run_local gained `apps` (issue 38)
    out = tmp_path / "probe"
    command = ["experiments/apf_stability_probe.py", "--window", "2", "--out", str(out)]
    command += ["rounds=3", "num_clients=4", "clients_per_round=4", "local_steps=2"]
    proc = python_run([sys.executable, "-c", "import runpy, sys; sys.argv = sys.argv[1:]; "
                       "runpy.run_path(sys.argv[0], run_name='__main__')", *command])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert (
        "over the last 2 rounds (rounds=3 num_clients=4 clients_per_round=4 local_steps=2):"
        in lines
    )
    shares = {k.strip(): float(v) for k, v in (x.rsplit(":", 1) for x in lines if "share P" in x)}
    assert set(shares) == {"share P < 0.05", "share P < 0.2", "share P > 0.8"}
    assert (
        all(0 <= v <= 1 for v in shares.values())
        and shares["share P < 0.05"] <= shares["share P < 0.2"]
    )
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_the_kernel_benchmark_compares_each_kernel_with_the_form_it_replaced():
    """A tiny real run: six rows; the ReLU backward and the gather equal their old forms bit
    for bit on any CPU, the others at most by rounding (log_softmax's class-major kernel is
    bit-identical under AVX-512 dispatch, not under the suite's AVX2)."""
    command = [sys.executable, "experiments/bench_kernels.py", "--repeats", "1", "--calls", "1"]
    proc = python_run(command, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "×" in line]
    rows = [row for row in rows if not row.startswith("| kernel")]
    assert len(rows) == 6, proc.stdout
    values = [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows]
    assert values[1] == values[2] == "bit-identical", rows
    for value in values:
        assert value == "bit-identical" or float(value.removeprefix("max |diff| ")) < 1e-5, rows
