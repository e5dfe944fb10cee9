"""logger=wandb: the offline run directory holds the same per-round history as metrics.jsonl."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import read_metrics, run_fl
from wandb.proto import wandb_internal_pb2

from fl.common.config import compose
from fl.common.files import NotRegularFile
from fl.run.tracking import RunLog

BLOCK, HEADER = 32768, 7  # W&B's run file uses LevelDB's log format after a 7-byte file header


def _records(path: Path) -> list[bytes]:
    """Payloads of a .wandb file (LevelDB log records, reassembling FIRST/MIDDLE/LAST)."""
    data, pos, out, pending = path.read_bytes(), HEADER, [], b""
    assert data[:4] == b":W&B"
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        body, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        if kind == 0 and length == 0:
            break
        pending += body
        if kind in (1, 4):  # FULL or LAST
            out.append(pending)
            pending = b""
    return out


def test_wandb_offline_run_holds_the_history(tmp_path):
    run_fl(tmp_path, "experiment=smoke", "logger=wandb")
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = []
    for payload in _records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
    rows = read_metrics(tmp_path)
    assert [h["round"] for h in history] == [r["round"] for r in rows] == [1, 2, 3]
    for logged, row in zip(history, rows, strict=True):
        assert logged["accuracy"] == row["accuracy"]
        assert logged["bytes_up"] == row["bytes_up"]


def test_a_wandb_folder_that_is_a_link_is_refused_before_wandb_writes(tmp_path):
    """W&B writes under the run's `wandb/`; a link planted there would send its files
    elsewhere: the run is refused in one line and nothing lands at the link's target."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").symlink_to(elsewhere, target_is_directory=True)
    cfg = compose(["experiment=smoke", "logger=wandb"])
    with pytest.raises(NotRegularFile, match="not a directory"):
        RunLog(run_dir, cfg)
    assert list(elsewhere.iterdir()) == []
