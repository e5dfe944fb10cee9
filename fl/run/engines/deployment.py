"""The `deployment` engine: submit this repo as a Flower App to a running SuperLink."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pathspec  # what flwr itself reads .gitignore with
import tomli_w  # a dependency of flwr itself, which writes the same file with it
from omegaconf import DictConfig

from fl.common.config import CONF_DIR
from fl.common.files import read_regular_text, write_atomic

__all__ = [
    "CONNECTION",
    "app_files",
    "flower_connection",
    "flower_home",
    "server_overrides",
    "staged_app",
    "submit_to_superlink",
]

REPO = CONF_DIR.parent  # the App: pyproject.toml, .gitignore and the packages
CONNECTION = "fl-run"  # the SuperLink connection we write into the Flower config file
STARTED = re.compile(r"Successfully started run (\d+)")
STATUS_WAIT_S = 30.0


def _key(override: str) -> str:
    """The config key a Hydra override sets (`+a.b=1`, `~a.b`, `a.b=1` -> `a.b`)."""
    return override.lstrip("+~").split("=", 1)[0]


def server_overrides(task_overrides: Iterable[str], output_dir: str) -> str:
    """The override string the ServerApp and ClientApps compose their config from.

    The user's own overrides, minus any `output_dir` (outputs go where `output_dir`
    says on the SuperLink's machine, so it must be absolute), plus ours.
    """
    if not Path(output_dir).is_absolute():
        raise SystemExit(f"fl-run: output_dir={output_dir!r} must be an absolute path")
    kept = [o for o in task_overrides if _key(o) != "output_dir"]
    for override in kept:
        # fl.common.config.from_run_config splits the string on whitespace.
        if any(c.isspace() for c in override):
            raise SystemExit(f"fl-run: override {override!r} contains whitespace, unsupported")
    return " ".join([*kept, f"output_dir={output_dir}"])


def _output_dir(cfg: DictConfig, task_overrides: list[str]) -> str:
    """An explicit `output_dir=` override names a path on the SuperLink's machine; else
    the local Hydra run directory (right when the SuperLink runs on this machine)."""
    explicit = [o.split("=", 1)[1] for o in task_overrides if _key(o) == "output_dir" and "=" in o]
    return explicit[-1] if explicit else str(Path(cfg.output_dir).resolve())


def flower_connection(cfg: DictConfig) -> dict[str, Any]:
    """The `[superlink.fl-run]` entry of the Flower config file for `cfg.engine`."""
    conn: dict[str, Any] = {"address": str(cfg.engine.superlink)}
    if cfg.engine.insecure:
        conn["insecure"] = True
    elif cfg.engine.root_certificates:
        conn["root-certificates"] = str(Path(cfg.engine.root_certificates).expanduser().resolve())
    return conn


@contextmanager
def flower_home(cfg: DictConfig) -> Iterator[Path]:
    """A FLWR_HOME whose config.toml holds our connection.

    A user-set FLWR_HOME is used as is (its other connections and `flwr login`
    credentials are kept; only `[superlink.fl-run]` is rewritten); otherwise a private
    temporary one, so fl-run never touches ~/.flwr.
    """
    user_home = os.environ.get("FLWR_HOME")
    tmp = None if user_home else tempfile.TemporaryDirectory(prefix="fl-flwr-home-")
    home = Path(user_home) if user_home else Path(tmp.name)  # type: ignore[union-attr]
    try:
        path = home / "config.toml"
        config = tomllib.loads(read_regular_text(path)) if path.exists() else {}
        config.setdefault("superlink", {})[CONNECTION] = flower_connection(cfg)
        home.mkdir(parents=True, exist_ok=True)
        write_atomic(path, tomli_w.dumps(config))
        yield home
    finally:
        if tmp is not None:
            tmp.cleanup()


def app_files(root: Path) -> list[str]:
    """The App's files under `root` (relative POSIX paths): every file `.gitignore` keeps,
    found without entering ignored folders (a virtualenv, run outputs) or `.git`.

    `flwr run DIR` lists and resolves every file under DIR before it applies `.gitignore`:
    tens of thousands with a virtualenv inside, seconds of a submission.
    """
    ignore = root / ".gitignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    ignored = pathspec.GitIgnoreSpec.from_lines(lines)
    found = []
    for folder, subfolders, names in os.walk(root):
        here = Path(folder).relative_to(root)
        subfolders[:] = [
            d
            for d in subfolders
            if d != ".git"
            and not os.path.islink(os.path.join(folder, d))
            and not ignored.match_file(f"{(here / d).as_posix()}/")
        ]
        for name in names:
            path = (here / name).as_posix()
            if not os.path.islink(os.path.join(folder, name)) and not ignored.match_file(path):
                found.append(path)
    return sorted(found)


@contextmanager
def staged_app(root: Path = REPO) -> Iterator[Path]:
    """A temporary copy of the App's files (`app_files`), for `flwr run` to pack: the same
    FAB as from `root` itself, without walking what `.gitignore` excludes."""
    with tempfile.TemporaryDirectory(prefix="fl-run-app-") as tmp:
        for name in app_files(root):
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, Path(tmp) / name)
        yield Path(tmp)


def _flwr() -> str:
    """The `flwr` CLI next to this interpreter (the venv's), else the one on PATH."""
    sibling = Path(sys.executable).with_name("flwr")
    found = str(sibling) if sibling.exists() else shutil.which("flwr")
    if found is None:
        raise SystemExit("fl-run: the `flwr` command is not installed")
    return found


def _run_status(run_id: str, env: dict[str, str]) -> tuple[str, str]:
    """(status, details) of a run, e.g. ('finished:failed', 'ServerApp failed with ...')."""
    proc = subprocess.run(
        [_flwr(), "ls", CONNECTION, "--run-id", run_id, "--format", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        run = json.loads(proc.stdout[proc.stdout.index("{") :])["runs"][0]
    except (ValueError, KeyError, IndexError):
        return "unknown", (proc.stdout + proc.stderr).strip()
    return str(run["status"]), str(run.get("status-details", ""))


def _wait_finished(run_id: str, env: dict[str, str]) -> tuple[str, str]:
    """The run's final status; the log stream can end a moment before the status flips."""
    deadline = time.monotonic() + STATUS_WAIT_S
    status, details = _run_status(run_id, env)
    while not status.startswith("finished") and time.monotonic() < deadline:
        time.sleep(1.0)
        status, details = _run_status(run_id, env)
    return status, details


def submit_to_superlink(cfg: DictConfig) -> None:
    """`flwr run` this repo on `cfg.engine.superlink` with this fl-run's overrides.

    With `engine.stream` it follows the run's log to the end and exits non-zero unless
    the run finished as completed; without, it returns once the run is submitted.
    """
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.job.config_name != "config":
        # Every app process composes from conf/config.yaml; another primary config
        # would silently give the server and clients a different run.
        raise SystemExit("fl-run: engine=deployment supports only the default config name")
    task = [str(o) for o in hydra_cfg.overrides.task]
    output_dir = _output_dir(cfg, task)
    overrides = server_overrides(task, output_dir)

    with (
        flower_home(cfg) as home,
        tempfile.TemporaryDirectory(prefix="fl-run-cfg-") as tmp,
        staged_app() as app,
    ):
        # A TOML file for `-c` carries any characters; the inline form
        # `-c "overrides='...'"` cannot hold a quote of its own kind.
        run_config = Path(tmp) / "run-config.toml"
        write_atomic(run_config, tomli_w.dumps({"overrides": overrides}))
        cmd = [_flwr(), "run", str(app), CONNECTION, "-c", str(run_config)]
        if cfg.engine.stream:
            cmd.append("--stream")
        env = {**os.environ, "FLWR_HOME": str(home)}
        print(f"fl-run: submitting to {cfg.engine.superlink}: overrides={overrides!r}", flush=True)
        run_id = _run_and_echo(cmd, env)
        if not cfg.engine.stream:
            print(f"fl-run: submitted run {run_id}; follow it with `flwr log {run_id} <conn>`")
            return
        status, details = _wait_finished(run_id, env)
    if status != "finished:completed":
        raise SystemExit(f"fl-run: run {run_id} ended as {status}: {details}")
    print(f"fl-run: run {run_id} completed; outputs in {output_dir} on the SuperLink's machine")


def _run_and_echo(cmd: list[str], env: dict[str, str]) -> str:
    """Run the flwr CLI, echo its output, return the run id it started."""
    run_id = None
    with subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if run_id is None and (match := STARTED.search(line)):
                run_id = match.group(1)
    if proc.returncode != 0:
        raise SystemExit(f"fl-run: `flwr run` failed with exit code {proc.returncode}")
    if run_id is None:
        raise SystemExit("fl-run: `flwr run` did not report a run id")
    return run_id
