"""The `flower-sim` engine: our ServerApp and ClientApp on Flower's own Ray simulation."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

# A Ray started here is this machine's own (no RAY_ADDRESS): its node address is loopback.
# Without this, Ray's import probes 8.8.8.8 for a "public" address and, offline, prints a
# warning before the table. Read once, when Ray is imported below; a cluster is left alone.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import tomli_w  # a dependency of flwr itself
from flwr.app import Context, RecordDict
from flwr.common.constant import RUN_ID_NUM_BYTES, SUPERLINK_NODE_ID, TASK_ID_NUM_BYTES
from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
from flwr.simulation.run_simulation import _run_simulation
from flwr.supercore.constant import NOOP_FEDERATION_ID
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.supercore.telemetry import EventType
from omegaconf import DictConfig

from fl.common.files import write_atomic
from fl.run.apps import Apps
from fl.run.console import flower_logs_once

__all__ = ["backend_config", "run_flower_simulation"]


def _cores() -> int:
    """CPU cores this process may use (respects taskset/cgroup affinity, unlike cpu_count)."""
    return len(os.sched_getaffinity(0))


def backend_config(cfg: DictConfig) -> dict[str, Any]:
    """Ray backend settings: one actor per `num_cpus_per_client` cores, no dashboard."""
    init_args: dict[str, Any] = {"include_dashboard": False}
    # Ray refuses resource arguments when it joins an existing cluster (RAY_ADDRESS set);
    # then the cluster's own resources decide how many actors run.
    if not os.environ.get("RAY_ADDRESS"):
        init_args["num_cpus"] = _cores()
    return {
        "client_resources": {
            "num_cpus": cfg.engine.num_cpus_per_client,
            "num_gpus": cfg.engine.num_gpus_per_client,
        },
        "init_args": init_args,
    }


def _app_dir(root: Path, run_config: dict[str, Any], apps: Apps) -> Path:
    """A minimal Flower app directory whose `[tool.flwr.app.config]` declares our keys.

    Flower builds each simulated node's `Context.run_config` by fusing the app's
    pyproject config with the run's overrides, and refuses override keys the app does
    not declare; without an app dir every node would get an empty run_config. The
    repo's own pyproject declares only `overrides` (for `flwr run`), while fl-run ships
    the whole resolved config under `fl-config`, so we declare exactly the keys we send.
    """
    app = {
        "publisher": "adaptive-fl",
        "components": {"serverapp": apps.server_ref, "clientapp": apps.client_ref},
        "config": dict.fromkeys(run_config, ""),
    }
    pyproject = {
        "project": {"name": "adaptive-fl", "version": "0.1.0"},
        "tool": {"flwr": {"app": app}},
    }
    write_atomic(root / "pyproject.toml", tomli_w.dumps(pyproject))
    return root


def _new_run(run_config: dict[str, Any]) -> Run:
    """A pre-registered run carrying our run_config, as `flwr-simulation` builds one."""
    run = Run.create_empty(generate_rand_int_from_bytes(RUN_ID_NUM_BYTES))
    run.primary_task_id = generate_rand_int_from_bytes(TASK_ID_NUM_BYTES)
    run.federation_id = NOOP_FEDERATION_ID
    run.override_config = dict(run_config)
    # Messages read the run identity from this process global; with `run` given,
    # _run_simulation leaves it to us.
    TaskIdentity.run_id = run.run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    TaskIdentity.task_id = run.primary_task_id
    return run


def run_flower_simulation(cfg: DictConfig, run_config: dict[str, Any], apps: Apps) -> None:
    """Run `apps.server` with `cfg.num_clients` `apps.client` nodes on Ray.

    Raises whatever the ServerApp raised, so `fl-run` exits non-zero when training fails.
    """
    flower_logs_once()  # importing flwr reset its logger to DEBUG with a second console
    # Ray's tip that a future version will stop hiding GPUs from num_gpus=0 actors: we keep
    # today's behaviour (a client asked for no GPU sees none), so the tip says nothing to us.
    warnings.filterwarnings(
        "ignore", message="Tip: In future versions of Ray", category=FutureWarning
    )
    run = _new_run(run_config)
    context = Context(
        run_id=run.run_id,
        node_id=0,  # as the local engine and Flower's own default server Context
        node_config={},
        state=RecordDict(),
        run_config=dict(run_config),
    )
    with tempfile.TemporaryDirectory(prefix="fl-sim-app-") as tmp:
        # `_run_simulation` is private, but it is what Flower's own `flwr-simulation`
        # process calls (flwr/simulation/app.py); the public `run_simulation` wrapper is
        # deprecated and cannot pass a run_config or a server Context.
        _run_simulation(
            num_supernodes=cfg.num_clients,
            client_app=apps.client,
            server_app=apps.server,
            backend_config=backend_config(cfg),
            server_app_context=context,
            app_dir=str(_app_dir(Path(tmp), run_config, apps)),
            is_app=True,
            run=run,
            exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
        )
