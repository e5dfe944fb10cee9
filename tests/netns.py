"""Run commands in a fresh network namespace that has only loopback (nothing leaves it)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

__all__ = ["in_netns", "require_netns"]

# `ip link set lo up` first: a new namespace's loopback starts down.
_SHELL = 'ip link set lo up && exec "$@"'


def _unshare() -> list[str]:
    # Unprivileged users need a user namespace (-r: map themselves to root) to get a net ns.
    return ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-r", "-n"]


def in_netns(cmd: list[str]) -> list[str]:
    """`cmd` wrapped so that it runs in a new loopback-only network namespace."""
    return [*_unshare(), "sh", "-c", _SHELL, "sh", *cmd]


@functools.cache
def _netns_error() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs `unshare` and `ip` (util-linux, iproute2)"
    probe = subprocess.run(in_netns(["true"]), capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    return None


def require_netns() -> None:
    """Skip the calling test where loopback-only network namespaces are unavailable."""
    error = _netns_error()
    if error is not None:
        pytest.skip(error)
