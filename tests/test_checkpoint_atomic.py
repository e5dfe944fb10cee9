"""Checkpoints survive `kill -9` mid-write: a reader finds the old or the new one, never a torn one.

A child process writes large checkpoints in a loop and reports each completed save; we
SIGKILL it at a random moment and load what is on disk. The same kill against a naive
`torch.save(path)` loop shows the test can see torn files at all.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import python_popen

from fl.run.checkpoint import load_checkpoint

SCALARS = 8 * 2**20  # 32 MiB of float32 per checkpoint: writes take long enough to be hit
WRITER = """
import sys
from pathlib import Path

import torch

from fl.run.checkpoint import save_checkpoint

path, atomic = Path(sys.argv[1]), sys.argv[2] == "atomic"
for i in range(1, 1_000_000):
    payload = {"i": i, "values": torch.full((int(sys.argv[3]),), float(i))}
    if atomic:
        save_checkpoint(path, payload)
    else:  # the naive way, for contrast: write in place
        with path.open("wb") as f:
            torch.save(payload, f)
    print(i, flush=True)
"""


def _kill_mid_loop(path: Path, mode: str, rng: random.Random) -> int:
    """Run the writer, SIGKILL it during a later save; return the last save it reported."""
    proc = python_popen([sys.executable, "-c", WRITER, str(path), mode, str(SCALARS)], stream=True)
    assert proc.stdout is not None
    try:
        started = time.monotonic()
        assert proc.stdout.readline().strip() == "1", "the writer never finished a save"
        one_save = time.monotonic() - started
        proc.stdout.readline()  # a second save: the file now exists and is being replaced
        time.sleep(rng.uniform(0, min(one_save, 1.0)))
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read().split()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return int(rest[-1]) if rest else 2


def _consistent(payload: dict) -> bool:
    values = payload["values"]
    return values.numel() == SCALARS and bool((values == float(payload["i"])).all())


def test_kill_9_during_atomic_saves_leaves_the_old_or_the_new_checkpoint(tmp_path):
    rng = random.Random(6)
    interrupted = trials = 0
    while trials < 3 or (interrupted < 2 and trials < 8):
        path = tmp_path / f"t{trials}" / "checkpoint.pt"
        path.parent.mkdir()
        last = _kill_mid_loop(path, "atomic", rng)
        payload = load_checkpoint(path, required=("i", "values"))  # must load: never corrupt
        # the old one, or the new one just renamed (or the previous one, when the kill landed
        # between moving the old one aside and renaming the new one into place)
        assert payload["i"] in (last, last + 1)
        assert _consistent(payload)
        # A temporary file left behind: the kill landed between its creation and the rename.
        interrupted += path.with_name(path.name + ".tmp").exists()
        trials += 1
    assert interrupted >= 2, f"only {interrupted} of {trials} kills landed during a save"


def test_the_same_kill_tears_a_naive_in_place_save(tmp_path):
    rng = random.Random(7)
    for trial in range(6):
        path = tmp_path / f"t{trial}" / "checkpoint.pt"
        path.parent.mkdir()
        _kill_mid_loop(path, "naive", rng)
        try:
            if not _consistent(torch.load(path, weights_only=True)):
                return
        except Exception:  # torn: what the atomic save prevents
            return
    pytest.fail("six kills of a naive in-place save never left a torn file")
