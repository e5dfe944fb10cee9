"""Our generic top-level package names (server, clients, ...) are ours, or fail in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, fl_env


def _import_fl(cwd) -> subprocess.CompletedProcess[str]:
    # `python -c` puts the working directory first on sys.path, as Flower does an app's folder
    return subprocess.run(
        [sys.executable, "-c", "import fl, server, clients, strategies, privacy"],
        cwd=cwd,
        env=fl_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("shadow", ["server.py", "clients/__init__.py", "strategies.py"])
def test_a_module_that_shadows_ours_is_named(tmp_path, shadow):
    (tmp_path / shadow).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / shadow).write_text("x = 1\n")
    proc = _import_fl(tmp_path)
    assert proc.returncode != 0
    name = shadow.split("/")[0].removesuffix(".py")
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ImportError: adaptive-fl: the top-level package {name!r} resolves to "
        f"{tmp_path / shadow}, not to {REPO / name}; rename that module or run from another "
        "directory (docs/PACKAGING.md)"
    )


def test_our_own_packages_import_from_anywhere(tmp_path):
    proc = _import_fl(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
