"""Bad keys and values end in one line naming the key and a non-zero exit, never a traceback.

Most cases call `validate` / `preflight` in-process (fast); a few run `fl-run` for real to
prove the end-to-end contract: exit 1, the last stderr line names the key, no traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import fl_env, fl_run_cmd, python_run

from fl.common.config import CONF_DIR, ConfigError, compose
from fl.run.cli import preflight
from fl.run.validation import validate
from fl.world.data import DATA_DIR_ENV

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")

# (overrides, substring the one-line message must contain)
REFUSED_BY_VALIDATE = [
    (["seed=-1"], "seed=-1: must be an integer in [0, 4294967295]"),
    (["seed=abc"], "seed='abc': must be an integer"),
    (["task.hidden=abc"], "task.hidden='abc': must be a list of layer widths"),
    (["task.hidden=[0]"], "task.hidden=[0]: must be a list of layer widths"),
    (["lr=inf"], "lr=inf: must be a finite number > 0"),
    (["lr=nan"], "lr=nan: must be a finite number > 0"),
    (["momentum=inf"], "momentum=inf: must be a finite number"),
    (["round_timeout_s=inf"], "round_timeout_s=inf: must be null or a finite number > 0"),
    (["time_budget_s=inf"], "time_budget_s=inf: must be null or a finite number"),
    (["system.speed=inf"], "system.speed=inf: must be a finite number"),
    (["partition.alpha=inf"], "partition.alpha=inf: must be a finite number"),
    (["privacy=dpsgd", "privacy.noise_multiplier=inf"], "privacy.noise_multiplier=inf"),
    (
        ["partition=shards", "partition.classes_per_client=0"],
        "partition.classes_per_client=0: must be an integer >= 1",
    ),
    (["strategy=fedprox", "strategy.mu=abc"], "strategy.mu='abc': must be a finite number"),
    (["strategy=fedprox", "strategy.mu=inf"], "strategy.mu=inf: must be a finite number"),
    (["strategy=apf", "strategy.threshold=abc"], "strategy.threshold='abc'"),
    (["strategy=gift", "local_steps=5", "strategy.increase=yes"], "strategy.increase='yes'"),
    (["strategy=pas", "local_steps=5", "strategy.levels=1.5"], "strategy.levels=1.5"),
    (["+round=5"], "unknown key 'round' (not in conf/config.yaml); did you mean rounds?"),
    (["+lrr=0.1"], "unknown key 'lrr' (not in conf/config.yaml); did you mean lr?"),
    (
        ["+zzzzqq=1"],
        "unknown key 'zzzzqq' (not in conf/config.yaml); known keys: aggregation, batch_size",
    ),
    (["output_dir=../x"], "output_dir='../x': fl-run sets it to the Hydra run directory"),
    (["experiment=dpbalance", "privacy.ledger.path=''"], "privacy.ledger.path='': this preset"),
    (["experiment=dpbalance", "privacy.ledger.path=null"], "privacy.ledger.path=None"),
    (["transport=grpc", "transport.tls=sometimes"], "transport.tls='sometimes': must be auto"),
    (["transport=grpc", "transport.listen=nohost"], "transport.listen='nohost': must be HOST:PORT"),
    (["transport=grpc", "transport.advertise=h:70000"], "transport.advertise='h:70000'"),
    (["transport=grpc", "transport.min_bytes=-1"], "transport.min_bytes=-1: must be an integer"),
    (["transport=grpc", "transport.chunk_bytes=0"], "transport.chunk_bytes=0: must be an integer"),
    (["transport=grpc", "transport.timeout_s=0"], "transport.timeout_s=0: must be a finite number"),
    (["transport=grpc", "transport.name=ucx"], "transport.name='ucx': must be one of"),
    (["resume=maybe"], "resume='maybe': must be true or false"),
    (["overwrite=1"], "overwrite=1: must be true or false"),
    (["engine.state_memory_mb=-1"], "engine.state_memory_mb=-1: must be a finite number >= 0"),
    (["engine.state_memory_mb=abc"], "engine.state_memory_mb='abc': must be a finite number"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED_BY_VALIDATE)
def test_validate_refuses_by_name_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(compose(overrides))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["round_timeout_s=null"],
        ["round_timeout_s=5"],
        ["experiment=dpbalance"],  # its ledger path is set
        ["output_dir=/srv/runs/a"],  # the ServerApp's view: fl-run's absolute run directory
        ["task.hidden=[128,64]"],
        ["transport=grpc", "transport.listen=0.0.0.0:7000", "transport.advertise='[::1]:7000'"],
        ["partition=shards", "partition.classes_per_client=3"],
        *(
            [f"strategy={path.stem}", "local_steps=5"]
            for path in sorted((CONF_DIR / "strategy").glob("*.yaml"))
        ),
    ],
)
def test_valid_configs_pass_validate(overrides):
    validate(compose(overrides))


def test_the_dpbalance_preset_requires_its_ledger():
    assert compose(["experiment=dpbalance"]).privacy.ledger.required is True


def _preflight_error(overrides: list[str]) -> str:
    cfg = compose(overrides)
    validate(cfg)  # these pass validate: only the data, hardware or user's output_dir fail
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_preflight_names_the_missing_mnist_files(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))  # an empty data root, whatever data/ holds
    message = _preflight_error(["task=mnist"])
    assert f"task.dataset='mnist': dataset files not found in {tmp_path / 'MNIST' / 'raw'}" in (
        message
    )
    assert "train-images-idx3-ubyte" in message


def test_preflight_says_how_many_clients_the_data_allows():
    message = _preflight_error(["num_clients=5000", "clients_per_round=5"])
    assert "num_clients=5000: partition=dirichlet of digits" in message
    assert "use at most 718 clients" in message  # 1,437 training images, min_size 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["partition.alpha=0.01", "num_clients=200"], "raise alpha, lower min_size"),
        (["partition=shards", "partition.classes_per_client=1", "num_clients=718"], "min_size=2"),
    ],
)
def test_preflight_refuses_a_partition_that_starves_a_client(overrides, message):
    error = _preflight_error([*overrides, "clients_per_round=5"])
    assert error.startswith(f"invalid config: {overrides[-1]}: partition=") and message in error


@NO_GPU
def test_preflight_refuses_cuda_without_a_gpu():
    message = _preflight_error(["device=cuda"])
    assert "device='cuda': no CUDA device is visible" in message
    assert "use device=auto" in message


def test_preflight_refuses_a_user_output_dir_except_for_deployment(monkeypatch):
    message = _preflight_error(["output_dir=/srv/runs/a"])
    assert "output_dir='/srv/runs/a'" in message and "hydra.run.dir=" in message
    # deployment: a path on the SuperLink's machine; its data and GPUs are not checked here
    monkeypatch.setattr("fl.world.task.get_task", lambda cfg: pytest.fail("loaded data"))
    preflight(compose(["output_dir=/srv/runs/a", "engine=deployment", "task=mnist"]))


def test_preflight_passes_a_good_config():
    preflight(compose(["partition=iid"]))


# End to end: one case per kind of check (validate, data, hardware, output_dir).
END_TO_END = [
    pytest.param(["+lrr=0.1"], "unknown key 'lrr'", id="unknown-key"),
    pytest.param(["strategy=fedprox", "strategy.mu=abc"], "strategy.mu='abc'", id="strategy"),
    pytest.param(["seed=abc"], "seed='abc'", id="seed"),
    pytest.param(["output_dir=../x"], "output_dir='../x'", id="output-dir"),
    pytest.param(["task=mnist"], "MNIST/raw", id="mnist"),
    pytest.param(["num_clients=5000", "clients_per_round=5"], "at most 718", id="num-clients"),
    pytest.param(["device=cuda"], "device='cuda'", id="cuda", marks=NO_GPU),
]


@pytest.mark.parametrize(("overrides", "message"), END_TO_END)
def test_fl_run_exits_with_one_line(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    env = {**fl_env(), DATA_DIR_ENV: str(tmp_path / "data")}  # no MNIST, whatever data/ holds
    proc = python_run(fl_run_cmd(f"hydra.run.dir={run_dir}", *overrides), env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("fl-run: invalid config: ") and message in last
    assert not Path(run_dir / "metrics.jsonl").exists()


# Refused before Hydra composes anything: one line with the choices, not Hydra's dump.
@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["strategy=nonexistent"], "fl-run: strategy=nonexistent: no such option; choices: "),
        (["task=nonexistent"], "fl-run: task=nonexistent: no such option; choices: cifar10, "),
        (["transport=bogus"], "fl-run: transport=bogus: no such option; choices: grpc, inline"),
        (["-m", "strategy=fedavg,bogus"], "fl-run: strategy=bogus: no such option; choices: "),
    ],
)
def test_an_unknown_group_option_is_one_line_with_the_choices(tmp_path, overrides, line):
    proc = python_run(fl_run_cmd(f"hydra.run.dir={tmp_path / 'run'}", *overrides), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[-1]]
    assert proc.stderr.strip().startswith(line)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fork_from=/nonexistent/run"], "no checkpoint at /nonexistent/run/checkpoint.pt"),
        (["engine.state_memory_mb=-1"], "engine.state_memory_mb=-1"),
    ],
)
def test_a_refused_run_leaves_no_saved_command_line(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    proc = python_run(fl_run_cmd(f"hydra.run.dir={run_dir}", *overrides), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]
    assert not (run_dir / ".hydra").exists()


def test_a_transport_address_of_another_machine_is_one_line(tmp_path):
    overrides = [
        "transport=grpc",
        "transport.listen=192.0.2.1:0",
        "rounds=1",
        "num_clients=2",
        "clients_per_round=2",
    ]
    proc = python_run(fl_run_cmd(f"hydra.run.dir={tmp_path}", *overrides), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fl-run: transport.listen=192.0.2.1:0: the bulk service cannot listen")


def test_synthetic_too_large_for_memory_is_refused_before_it_is_generated(monkeypatch):
    monkeypatch.setattr("fl.world.task.memory_bytes", lambda: 24 * 10**9)
    cfg = compose(["task=synthetic", "num_clients=1000000", "clients_per_round=100"])
    validate(cfg)
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    message = str(info.value)
    assert "generates all 1,000,000 devices in memory, about 45 GB" in message
    assert "more than this machine's 24 GB; use partition=natural" in message


def test_a_ledger_path_that_cannot_hold_a_ledger_is_one_line(tmp_path):
    overrides = ["privacy=dpsgd", "privacy.ledger.path=/proc/nope/x", "rounds=1"]
    proc = python_run(fl_run_cmd(f"hydra.run.dir={tmp_path}", *overrides), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "privacy.ledger.path=/proc/nope/x: cannot open a ledger there" in last
