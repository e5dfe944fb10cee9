"""experiments/archive_runs.py: a sweep kept in the repository reads as the sweep itself;
an archived metrics file that is not whole gzip, unpacks past the limit or to something
other than UTF-8 text, is refused; a scoreboard row read from kept sweeps regenerates from
them."""

from __future__ import annotations

import gzip
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from experiments import archive_runs, asfl_table, room_table, scoreboard
from fl.common.files import TEXT_LIMIT
from fl.run.compare import ARCHIVED_METRICS, find_runs, load_run

ROOT = Path(__file__).resolve().parent.parent
KEPT = ROOT / "experiments" / "records" / "sweeps"


Tool = Callable[[list[str]], int]  # a figures script's main: argv -> exit status


def _on_fedca_room(arm: str) -> tuple[list[str], dict[str, tuple[Tool, list[str]]]]:
    """A row of fedca_room read as its preset says: arm `arm`'s kept folders and FedAvg's,
    time to FedAvg's plateau − 1 point, and accuracy at the budget's end."""
    folders = [f"fedca_room/2026-12-07_{a}_s{seed}" for a in ("fedavg", arm) for seed in range(5)]
    time = "--reference strategy=fedavg --to-target 50 --margin 1 --reach-window 5"
    time += " --measure time --ratio-bar 0.85"
    return folders, {
        f"fedca_room/room_table_{arm}_time.json": (room_table.main, shlex.split(time)),
        f"fedca_room/room_table_{arm}_acc.json": (
            room_table.main,
            shlex.split("--reference strategy=fedavg --window 10 --bar -1"),
        ),
    }


def _on_asfl_room() -> tuple[list[str], dict[str, tuple[Tool, list[str]]]]:
    """ASFL's online row: its objective paired with SAFA's, FedBuff's and FedAvg's."""
    return ["asfl_room/2026-12-07_s012"], {
        f"asfl_room/asfl_table_vs_{ref}.json": (asfl_table.main, ["--reference", ref])
        for ref in ("safa", "fedbuff", "fedavg")
    }


# scoreboard rows read from kept sweeps: record -> (the kept folders, and for each figures
# file beside them, the script and its arguments; the record's command says the same)
FROM_KEPT = {
    "fedca": _on_fedca_room("fedca"),
    "fedca_plus": _on_fedca_room("plusfix"),
    "asfl": _on_asfl_room(),
    "pas": (
        ["pas_room/2026-12-07_fix"],
        {
            "pas_room/room_table.json": (
                room_table.main,
                shlex.split("--reference strategy=fedavg --equal-time --window 10"),
            )
        },
    ),
}

# rows recorded from kept sweeps by `scoreboard.py --record` (fl.run.compare's figures)
RECORDED_KEPT = {"fedsu": ["fedsu_room/2026-12-07_cpu", "fedsu_room/2026-12-07_cpu_seeds34"]}


def _sweep(tmp_path: Path) -> Path:
    """Two arms over two seeds, finished, with a checkpoint and a log that stay behind."""
    sweep = tmp_path / "out" / "2026-12-07_room"
    for job, (arm, seed) in enumerate((a, s) for s in (0, 1) for a in ("fedavg", "fedca")):
        folder = sweep / str(job)
        (folder / ".hydra").mkdir(parents=True)
        overrides = [f"strategy={arm}", f"seed={seed}", "experiment=fedca_room"]
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        (folder / "config.yaml").write_text(yaml.safe_dump({"seed": seed}))
        speed = 1.0 if arm == "fedavg" else 0.8
        rows = [
            {"round": r, "virtual_time_s": speed * r, "accuracy": min(0.9, 0.1 + 0.05 * r)}
            for r in range(1, 30)
        ]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / "summary.json").write_text(json.dumps({"final_accuracy": 0.9}))
        (folder / "checkpoint.pt").write_bytes(b"\0" * 1000)
        (folder / "run.log").write_text("log")
    (sweep / "sweep.json").write_text(json.dumps({"launched": ["0", "1", "2", "3"]}))
    return sweep


def test_an_archived_sweep_reads_and_tabulates_as_the_sweep(tmp_path, capsys):
    sweep = _sweep(tmp_path)
    archive_runs.main([str(sweep), "--to", str(tmp_path / "records")])
    kept = tmp_path / "records" / sweep.name
    assert sorted(p.name for p in (kept / "0").iterdir()) == [
        ".hydra",
        "config.yaml",
        ARCHIVED_METRICS,
        "summary.json",
    ]
    assert [load_run(job) for job in find_runs(kept)] == [load_run(job) for job in find_runs(sweep)]

    figures = []
    for folder in (sweep, kept):
        out = tmp_path / f"{folder.parent.name}.json"
        args = ["--reference", "strategy=fedavg", "--to-target", "5", "--measure", "time"]
        assert room_table.main([str(folder), *args, "--json", str(out)]) == 0
        figures.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert figures[0] == figures[1]
    assert figures[0]["arms"]["strategy=fedca"]["ratios"] == pytest.approx([0.8, 0.8])

    before = {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    archive_runs.main([str(sweep), "--to", str(tmp_path / "records")])  # again: same bytes
    assert {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()} == before


def test_a_broken_or_oversized_archive_is_refused(tmp_path):
    sweep = _sweep(tmp_path)
    archive_runs.main([str(sweep), "--to", str(tmp_path / "records")])
    job = tmp_path / "records" / sweep.name / "0"
    packed = (job / ARCHIVED_METRICS).read_bytes()
    (job / ARCHIVED_METRICS).write_bytes(packed[: len(packed) // 2])
    with pytest.raises(ValueError, match="not a whole gzip file"):
        load_run(job)
    (job / ARCHIVED_METRICS).write_bytes(gzip.compress(b"\n" * (TEXT_LIMIT + 1)))
    with pytest.raises(ValueError, match="unpacks to more than"):
        load_run(job)
    (job / ARCHIVED_METRICS).write_bytes(gzip.compress(b"\xff\xfe{}"))
    with pytest.raises(ValueError, match="does not unpack to UTF-8 text"):
        load_run(job)


def test_a_folder_without_finished_jobs_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no finished job"):
        archive_runs.main([str(tmp_path / "empty"), "--to", str(tmp_path / "records")])


def _committed_record(stem: str, tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """Record `stem` as committed, and a records folder holding a copy for a refill."""
    committed = json.loads((scoreboard.RECORDS / f"{stem}.json").read_text())
    records = tmp_path / "records"
    records.mkdir()
    (records / f"{stem}.json").write_text(json.dumps(committed))
    return committed, records


@pytest.mark.parametrize("stem", sorted(FROM_KEPT))
def test_a_scoreboard_row_regenerates_from_its_kept_sweeps(stem, tmp_path, capsys):
    """Issue 35's "regenerated from recorded sweeps": the figures script over the kept
    folders writes the kept figures, and they fill the committed record as it stands."""
    folders, figures = FROM_KEPT[stem]
    for name, (tool, args) in figures.items():
        out = tmp_path / "figures.json"
        assert tool([*(str(KEPT / f) for f in folders), *args, "--json", str(out)]) == 0
        assert json.loads(out.read_text()) == json.loads((KEPT / name).read_text())
    capsys.readouterr()

    committed, records = _committed_record(stem, tmp_path)
    source = committed["source"]
    kept = [KEPT / name for name in figures]
    again = scoreboard.record_figures(kept, stem, source["command"], source["date"], records)
    assert again["conditions"] == committed["conditions"]


@pytest.mark.parametrize("stem", sorted(RECORDED_KEPT))
def test_a_recorded_row_regenerates_from_its_kept_sweep(stem, tmp_path):
    """The same for a row `--record` filled from sweeps: the kept folders refill the
    committed record's conditions as they stand."""
    committed, records = _committed_record(stem, tmp_path)
    source = committed["source"]
    sweeps = [KEPT / name for name in RECORDED_KEPT[stem]]
    again = scoreboard.record_sweep(sweeps, stem, source["command"], source["date"], records)
    assert again["conditions"] == committed["conditions"]
