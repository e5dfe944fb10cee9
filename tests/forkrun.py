"""Test support: `python -m MODULE` / `python -c CODE` as real processes, without their imports.

Every `fl-run` used to cost about 5 s of CPU before round one, importing torch, Flower,
Hydra, scikit-learn and matplotlib; the suite starts dozens. Each pytest worker therefore
keeps one server process (`python tests/forkrun.py`) that has imported those third-party
libraries, none of our own code, and forks a child per command. The child is a real
process: its own pid (signals, SIGKILL, exit status as `Popen.returncode` reports it), its
working directory, its environment, stdin from /dev/null and stdout/stderr at the file
descriptor level (so Flower's and Hydra's handlers, tqdm and C code all land there). It
imports the project afresh from disk and runs the module as `python -m` does
(`runpy._run_module_as_main`), then exits as the interpreter would: atexit handlers, the
exit status of `SystemExit`, a traceback and status 1 for an uncaught exception.

What a child shares with its siblings and a fresh interpreter would not: the string-hash
seed (fixed when the server's interpreter started). Tests that compare runs for
determinism therefore keep one of the runs in a fresh interpreter (`fresh=True`), so that
a result depending on set iteration order would still show. Python's `random` and NumPy's
global generator are reseeded from the OS in every child, as in a fresh interpreter.

A command falls back to a plain subprocess when it is not `python -m`/`-c`, when its
environment differs from the server's in what an interpreter or an imported library reads
at start-up (PYTHON*, HOME, MPL*, OMP_*, ...), when the server cannot start (a warning says
why), or when `FL_TEST_FORK=0` (the whole suite on fresh interpreters, e.g. to check that it
passes the same way).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import locale
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ForkedProcess", "popen", "run"]

# Imported once by the server. Third-party only: the project is imported by each child.
PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",  # imported by the first optimizer step: over a second on its own
    "torch.nn",
    "torch.optim",
    "yaml",
    "omegaconf",
    "hydra",
    "hydra._internal.hydra",
    "hydra._internal.utils",
    "hydra.core.utils",
    "flwr.app",
    "flwr.clientapp",
    "flwr.serverapp",
    "flwr.serverapp.strategy",
    "flwr.common.serde",
    "flwr.superlink.grid",
    "matplotlib",
    "matplotlib.pyplot",  # after matplotlib.use("Agg"), as fl/run/plots.py does
)
# Environment an interpreter or a preloaded library reads when it starts: a command whose
# value differs from the server's runs in a fresh interpreter.
STARTUP_ENV = (
    *("PYTHON", "LANG", "LC_", "HOME", "TMPDIR", "XDG_", "LD_"),
    *("MPL", "OMP_", "MKL_", "OPENBLAS", "TORCH", "CUDA"),
)
DISABLED = os.environ.get("FL_TEST_FORK", "1") == "0"


# ----- the server (runs as `python tests/forkrun.py`) ------------------------------------------


def _serve() -> None:
    # The protocol runs on copies of fds 0 and 1; stray output of libraries goes to stderr.
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    import matplotlib

    matplotlib.use("Agg")
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            __import__(name)
    reply = os.fdopen(replies, "w", buffering=1)
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    running: set[int] = set()
    pending = b""
    while True:
        # Ended children are reaped every 20 ms while any runs (portable; no pidfds needed).
        readable, _, _ = select.select([requests], [], [], 0.02 if running else None)
        while running:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            cpu = usage.ru_utime + usage.ru_stime
            reply.write(json.dumps({"exited": pid, "returncode": code, "cpu": cpu}) + "\n")
        if not readable:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:
            return  # the pytest worker is gone
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(requests)
                os.close(replies)
                _child(request)  # never returns
            running.add(pid)
            reply.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")


def _child(request: dict[str, Any]) -> None:
    """Become `python ARGV` in `cwd` with `env` and the given stdout/stderr; exit with it."""
    code = 1
    try:
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        ):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import random
        import types

        import numpy as np
        import torch

        random.seed()  # seeded from the OS, as in a fresh interpreter
        np.random.seed()
        torch.seed()
        main = types.ModuleType("__main__")  # an empty __main__, not this file's
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        kind, target, *args = request["argv"]
        sys.path[0] = os.getcwd() if kind == "-m" else ""  # as `python -m` / `python -c` set it
        if kind == "-m":
            import runpy

            sys.argv = [target, *args]  # runpy puts the module's file first
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:
        import traceback

        # from the module's own frames on, as the interpreter prints it (not this function's)
        frames = error.__traceback__
        traceback.print_exception(type(error), error, frames.tb_next if frames else None)
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


# ----- the client, in each pytest worker ------------------------------------------------------


class _Server:
    """This worker's fork server, started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="forkrun-"))
        self.env = env
        self.log = (self.root / "server.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=Path(__file__).resolve().parent.parent,
            env=self.env,
        )
        self.ids = iter(range(1, 1 << 62))
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self.ready = False
        threading.Thread(target=self._read, daemon=True).start()
        with self.changed:
            if not self.changed.wait_for(lambda: self.ready or self.proc.poll() is not None, 300):
                raise RuntimeError("the fork server did not start in 300 s")
        if not self.ready:
            raise RuntimeError(f"the fork server failed: {self._log_tail()}")

    def _log_tail(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-3000:]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "ready" in message:
                    self.ready = True
                elif "exited" in message:
                    self.exits[message["exited"]] = message["returncode"]
                    global children_cpu_s
                    children_cpu_s += message["cpu"]
                else:
                    self.pids[message["id"]] = message["pid"]
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def spawn(self, argv: list[str], cwd: Path, env: dict[str, str], out: Path, err: Path) -> int:
        request: dict[str, Any] = {
            "argv": argv,
            "cwd": str(cwd),
            "env": env,
            "stdout": str(out),
            "stderr": str(err),
        }
        with self.changed:
            request["id"] = next(self.ids)
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            if not self.changed.wait_for(
                lambda: request["id"] in self.pids or self.proc.poll() is not None, 60
            ):
                raise RuntimeError("the fork server did not answer in 60 s")
            if request["id"] not in self.pids:
                raise RuntimeError(f"the fork server died: {self._log_tail()}")
            return self.pids.pop(request["id"])

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(
                lambda: pid in self.exits or self.proc.poll() is not None, timeout
            )
            if pid not in self.exits and self.proc.poll() is not None:
                raise RuntimeError(f"the fork server died: {self._log_tail()}")
            return self.exits.get(pid)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


_server: _Server | None = None
_no_server = ""  # why the server could not start: fresh interpreters from then on
children_cpu_s = 0.0  # CPU seconds of the forked children that ended (they are not ours to reap)
_server_lock = threading.Lock()


def _get_server(env: dict[str, str] | None = None) -> _Server | None:
    """This worker's server (the first caller's environment becomes the server's), or None
    if it cannot start here."""
    global _server, _no_server
    with _server_lock:
        if _server is None and not _no_server:
            try:
                _server = _Server(_env(env))
            except (OSError, RuntimeError) as err:
                _no_server = str(err) or type(err).__name__
                warnings.warn(f"no fork server, fresh interpreters: {_no_server}", stacklevel=3)
            else:
                atexit.register(_server.close)
        return _server


def _started_server() -> _Server:
    assert _server is not None, "no process was forked without a server"
    return _server


def _env(env: Mapping[str, str] | None) -> dict[str, str]:
    return dict(os.environ if env is None else env)


def _forkable(cmd: Sequence[str], env: dict[str, str]) -> list[str] | None:
    """`cmd` without the interpreter if a fork of the server can run it, else None."""
    if DISABLED or len(cmd) < 3 or str(cmd[0]) != sys.executable or cmd[1] not in ("-m", "-c"):
        return None
    server = _get_server(env)
    if server is None:
        return None
    for key in set(env) | set(server.env):
        if key.startswith(STARTUP_ENV) and env.get(key) != server.env.get(key):
            return None
    return [str(c) for c in cmd[1:]]


class _Follow:
    """A child's stdout file read as it grows: `readline` returns a line once it is complete
    (or the rest once the child has ended), as on a pipe."""

    def __init__(self, path: Path, proc: ForkedProcess) -> None:
        self._file = path.open(encoding=locale.getpreferredencoding(False))
        self._proc, self._pending = proc, ""

    def readline(self) -> str:
        while True:
            ended = self._proc.poll() is not None  # before reading: nothing comes after it
            self._pending += self._file.read()
            if "\n" in self._pending or ended:
                line, newline, self._pending = self._pending.partition("\n")
                return line + newline
            time.sleep(0.002)

    def read(self) -> str:
        self._proc.wait()
        rest, self._pending = self._pending + self._file.read(), ""
        return rest

    def close(self) -> None:
        self._file.close()


class ForkedProcess:
    """The part of `subprocess.Popen`'s interface the tests use, for a forked child.

    `stdout` is readable while the child runs when started with `stream=True`.
    """

    def __init__(
        self, args: list[str], pid: int, out: Path, err: Path, keep: tuple[bool, bool], stream: bool
    ):
        self.args, self.pid = args, pid
        self.returncode: int | None = None
        self._paths, self._keep = (out, err), keep
        self.stdout = _Follow(out, self) if stream else None
        self.stderr = None  # read with communicate()

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _started_server().wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = _started_server().wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def terminate(self) -> None:
        self.send_signal(15)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        self.wait(timeout)
        encoding = locale.getpreferredencoding(False)
        texts = []
        for path, keep in zip(self._paths, self._keep, strict=True):
            text = path.read_text(encoding=encoding) if keep and path.exists() else None
            texts.append(text)
        if self.stdout is not None:
            texts[0] = self.stdout.read()
            self.stdout.close()
        for path in self._paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return texts[0], texts[1]


def popen(
    cmd: Sequence[str],
    *,
    cwd: Path | str,
    env: Mapping[str, str] | None = None,
    capture: bool = True,
    stderr: bool = True,
    stream: bool = False,
    fresh: bool = False,
) -> ForkedProcess | subprocess.Popen[str]:
    """Start `cmd` (`[sys.executable, "-m" | "-c", ...]`): a fork of this worker's server,
    or a plain subprocess (`fresh`, or see the module docstring).

    `capture`: stdout kept for `communicate()` (else discarded); `stderr` likewise;
    `stream`: stdout also readable line by line while it runs (`proc.stdout.readline()`).
    Always text, as `subprocess` with `text=True`.
    """
    capture = capture or stream
    environment = _env(env)
    argv = None if fresh else _forkable(cmd, environment)
    if argv is None:
        pipe = subprocess.PIPE
        return subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=environment,
            stdout=pipe if capture else subprocess.DEVNULL,
            stderr=pipe if stderr else subprocess.DEVNULL,
            text=True,
        )
    server = _started_server()
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    out, err = server.root / f"{stamp}.out", server.root / f"{stamp}.err"
    paths = [str(out) if capture else os.devnull, str(err) if stderr else os.devnull]
    if stream:
        out.touch()  # before the child opens it: followed from its first byte
    pid = server.spawn(argv, Path(cwd), environment, Path(paths[0]), Path(paths[1]))
    return ForkedProcess(list(cmd), pid, out, err, (capture, stderr), stream)


def run(
    cmd: Sequence[str],
    *,
    cwd: Path | str,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, capture_output=True, text=True, ...)` through `popen`."""
    proc = popen(cmd, cwd=cwd, env=env, fresh=fresh)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(list(cmd), proc.wait(), out, err)


if __name__ == "__main__":
    _serve()
