"""The scoreboard: docs/REPRODUCTIONS.md is the renderer's output on the committed records,
its verdicts follow from interval and bar, and `--record` fills a record from a sweep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from experiments import scoreboard
from experiments.scoreboard import (
    FAILS,
    INCONCLUSIVE,
    REPRODUCES,
    RecordError,
    check_record,
    condition_verdict,
    load_records,
    record_sweep,
    render,
    verdict,
)
from fl.run.intervals import interval

SYSTEMS = [
    "APF",
    "APF#",
    "APF++",
    "PAS",
    "GIFT",
    "FedSU",
    "FedCA",
    "FedCA+",
    "2D-LRD",
    "ASFL",
    "R2SP",
    "FL-R2SP",
    "LB-BSP",
    "metric grafting",
    "DPBalance",
]


def test_the_committed_page_is_the_renderers_output():
    committed = scoreboard.DOC.read_text()
    assert render(load_records()) == committed, "run: python experiments/scoreboard.py"
    readme = (scoreboard.ROOT / "README.md").read_text().splitlines()
    after_commands = readme[readme.index("```", 3) + 1 : readme.index("```", 3) + 3]
    assert any("docs/REPRODUCTIONS.md" in line for line in after_commands)


def test_one_row_per_system_in_order():
    records = load_records()
    assert [r["system"] for r in records] == SYSTEMS
    rows = [line for line in scoreboard.DOC.read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows[1:]] == SYSTEMS


@pytest.mark.parametrize(
    "rule, low, high, expected",
    [
        ("at_most", 0.40, 0.55, REPRODUCES),  # wholly below the bar 0.6
        ("at_most", 0.55, 0.65, INCONCLUSIVE),  # holds it
        ("at_most", 0.60, 0.70, INCONCLUSIVE),  # touches it
        ("at_most", 0.61, 0.70, FAILS),
        ("at_least", 0.61, 0.70, REPRODUCES),
        ("at_least", 0.50, 0.60, INCONCLUSIVE),
        ("at_least", 0.40, 0.59, FAILS),
    ],
)
def test_a_conditions_verdict_follows_its_interval_and_bar(rule, low, high, expected):
    condition = {"rule": rule, "bar": 0.6, "lo": low, "hi": high}
    assert condition_verdict(condition) == expected


def _graft(group: str, lo: float, hi: float) -> list[dict[str, object]]:
    """One variant's two conditions (accuracy at least -1, bytes at most 1): the first with
    interval [lo, hi], the second passing."""
    accuracy = {"group": group, "rule": "at_least", "bar": -1.0, "lo": lo, "hi": hi}
    return [accuracy, {"group": group, "rule": "at_most", "bar": 1.0, "lo": 0.5, "hi": 0.7}]


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([(-3, -2), (0, 1), (-2, 0)], REPRODUCES),  # one variant holds: enough
        ([(-3, -2), (-4, -3)], FAILS),  # every variant fails
        ([(-3, -2), (-2, 0)], INCONCLUSIVE),  # one fails, one is open
    ],
)
def test_one_group_whose_conditions_all_hold_is_enough(intervals, expected):
    conditions = [c for k, (lo, hi) in enumerate(intervals) for c in _graft(f"g{k}", lo, hi)]
    assert verdict({"conditions": conditions}) == expected
    ungrouped = [{k: v for k, v in c.items() if k != "group"} for c in conditions]
    assert verdict({"conditions": ungrouped}) in (FAILS, INCONCLUSIVE)  # all must hold


def test_a_record_groups_every_condition_or_none():
    mixed = json.loads(json.dumps(load_records()[13]))  # metric grafting
    for c in mixed["conditions"]:
        c.pop("group", None)
    mixed["conditions"][0]["group"] = "graft_apf"
    with pytest.raises(RecordError, match="every condition or none has a group"):
        check_record(mixed, "grafting.json")


def test_every_committed_verdict_follows_the_rule():
    """Each record's verdict, recomputed here from its intervals: any condition wholly on
    the wrong side fails the system, all wholly on the right side pass it; a failure
    carries its measured reason, and the page shows the reason only for failures."""
    page = scoreboard.DOC.read_text()
    seen = set()
    for record in load_records():
        sides = []
        for c in record["conditions"]:
            missed, reached = c.get("missed", 0), len(c.get("seeds") or [])
            if missed * 2 > missed + reached:  # missed the target on most seeds: fails
                sides.append("bad")
                continue
            good = c["hi"] < c["bar"] if c["rule"] == "at_most" else c["lo"] > c["bar"]
            bad = c["lo"] > c["bar"] if c["rule"] == "at_most" else c["hi"] < c["bar"]
            good = good and not missed  # a seed that missed keeps it from reproducing
            sides.append("good" if good else "bad" if bad else "open")
        groups: dict[str, list[str]] = {}
        for c, side in zip(record["conditions"], sides, strict=True):
            groups.setdefault(c.get("group", ""), []).append(side)
        each = {
            FAILS if "bad" in g else REPRODUCES if set(g) == {"good"} else ""
            for g in groups.values()
        }
        expected = REPRODUCES if REPRODUCES in each else FAILS if each == {FAILS} else None
        assert verdict(record) == (expected or INCONCLUSIVE), record["system"]
        if verdict(record) == FAILS:
            assert len(record["reason"]) > 40 and record["reason"] in page
        row = next(line for line in page.splitlines() if line.startswith(f"| {record['system']} |"))
        assert f"**{verdict(record)}**" in row
        seen.add(verdict(record))
    assert seen == {REPRODUCES, FAILS, INCONCLUSIVE}  # the table can say each


def _run(folder: Path, overrides: list[str], final: float, traffic: float, time: float) -> None:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 1, "accuracy": final}) + "\n")
    summary = {
        "final_accuracy": final,
        "best_accuracy": final,
        "total_bytes_up": traffic,
        "total_bytes_down": 0,
        "total_payload_bytes_up": traffic,
        "total_payload_bytes_down": 0,
        "virtual_time_s": time,
        "time_to_target_s": time,
    }
    (folder / "summary.json").write_text(json.dumps(summary))


def test_record_mode_fills_a_record_from_a_sweeps_paired_figures(tmp_path):
    """FedAvg and APF over three seeds, in two sweeps read as one: APF's traffic and Δ
    accuracy, paired seed by seed, become the record's figures with fl.run.intervals'
    intervals; the verdict follows from them; the page renders from the new record."""
    sweep, later, records = tmp_path / "sweep", tmp_path / "later", tmp_path / "records"
    shutil.copytree(scoreboard.RECORDS, records)
    _small_workload_apf(records / "apf.json")
    apf = {0: (0.95, 50.0), 1: (0.94, 45.0), 2: (0.96, 55.0)}
    for seed, (final, traffic) in apf.items():  # seed 2 in a sweep of its own, run later
        folder, job = (sweep, 2 * seed) if seed < 2 else (later, 0)
        _run(folder / str(job), ["strategy=fedavg", f"seed={seed}"], 0.95, 100.0, 10.0)
        _run(folder / str(job + 1), ["strategy=apf", f"seed={seed}"], final, traffic, 9.0)
    record = record_sweep([sweep, later], "apf", "fl-run -m ...", "2026-12-05", folder=records)
    traffic, accuracy = record["conditions"]
    assert traffic["seeds"] == [0.5, 0.45, 0.55]
    assert (traffic["mean"], traffic["lo"], traffic["hi"]) == interval([0.5, 0.45, 0.55])
    assert accuracy["seeds"] == pytest.approx([0.0, -1.0, 1.0])
    assert verdict(record) == INCONCLUSIVE  # traffic [0.376, 0.624] holds the bar 0.6
    assert record["source"]["date"] == "2026-12-05"
    assert json.loads((records / "apf.json").read_text()) == record
    assert "**0.500** [0.376, 0.624]" in render(load_records(records))


def _small_workload_apf(path: Path) -> None:
    """APF's record as it was on the small workload: traffic and Δ accuracy of whole runs,
    the figures `--record` pairs from a sweep's summaries."""
    record = json.loads(path.read_text())
    record["conditions"] = [
        {
            "label": "traffic as sent × FedAvg",
            "arm": "strategy=apf",
            "metric": "traffic",
            "rule": "at_most",
            "bar": 0.6,
            "mean": 0.7,
            "lo": 0.6,
            "hi": 0.8,
            "seeds": None,
        },
        {
            "label": "Δ final accuracy (points)",
            "arm": "strategy=apf",
            "metric": "final_accuracy",
            "rule": "at_least",
            "bar": -1.0,
            "mean": 0.5,
            "lo": -0.5,
            "hi": 1.5,
            "seeds": None,
        },
    ]
    path.write_text(json.dumps(record))


def test_record_mode_names_a_missing_arm_and_a_seed_run_twice(tmp_path):
    sweep, records = tmp_path / "sweep", tmp_path / "records"
    shutil.copytree(scoreboard.RECORDS, records)
    for seed in (0, 1):
        _run(sweep / str(2 * seed), ["strategy=fedavg", f"seed={seed}"], 0.9, 1.0, 1.0)
        _run(sweep / str(2 * seed + 1), ["strategy=pas", f"seed={seed}"], 0.9, 1.0, 1.0)
    with pytest.raises(RecordError, match="no arm 'strategy=apf'"):
        record_sweep([sweep], "apf", "cmd", "2026-12-05", folder=records)
    with pytest.raises(RecordError, match="holds no finished run"):
        record_sweep([tmp_path / "empty"], "apf", "cmd", "2026-12-05", folder=records)
    with pytest.raises(RecordError, match="ran seed 0 twice"):  # one sweep read twice
        record_sweep([sweep, sweep], "pas", "cmd", "2026-12-05", folder=records)


def test_a_malformed_record_is_refused_with_its_fault():
    good = load_records()[0]
    bad = json.loads(json.dumps(good))
    bad["conditions"][0]["lo"] = bad["conditions"][0]["mean"] + 1
    with pytest.raises(RecordError, match="lo <= mean <= hi"):
        check_record(bad, "apf.json")
    failing = json.loads(json.dumps(load_records()[5]))  # FedSU: does not reproduce
    failing["reason"] = " "
    with pytest.raises(RecordError, match="a failure needs a reason"):
        check_record(failing, "fedsu.json")


def test_check_mode_says_when_the_page_is_stale(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "REPRODUCTIONS.md"
    stale.write_text("old\n")
    monkeypatch.setattr(scoreboard, "DOC", stale)
    assert scoreboard.main(["--check"]) == 1
    assert "is not up to date" in capsys.readouterr().err
    assert scoreboard.main([]) == 0
    assert scoreboard.main(["--check"]) == 0


def test_the_caveat_names_each_row_by_its_workload():
    caveat = render(load_records()).split("**Caveat (issue 35).**")[1].split("\n")[0]
    room, small = caveat.split("Measured on the small workloads")
    names = room.split(":")[1].strip(" .").split(", ")
    records = load_records()
    roomy = [r["system"] for r in records if r["source"]["workload"].startswith("with room")]
    smalls = [r["system"] for r in records if r["source"]["workload"].startswith("small")]
    assert names == roomy and "GIFT" in names and smalls
    assert small.split(";")[0].split(": ")[1].split(", ") == smalls
    assert "DPBalance" not in smalls  # no model: its own sentence
    assert "DPBalance: simulated budget scheduler (no FL model)." in caveat


def test_the_page_is_never_written_through_a_link(tmp_path, monkeypatch, capsys):
    target = tmp_path / "elsewhere.md"
    target.write_text("kept\n")
    (tmp_path / "REPRODUCTIONS.md").symlink_to(target)
    monkeypatch.setattr(scoreboard, "DOC", tmp_path / "REPRODUCTIONS.md")
    assert scoreboard.main([]) == 2
    assert "REPRODUCTIONS.md" in capsys.readouterr().err
    assert target.read_text() == "kept\n"


def _room_record(tmp_path: Path, metric: str, **condition: object) -> Path:
    """The committed records, with PAS's condition read from room_table.py's `metric` (and
    a reason, should the figure fail)."""
    records = tmp_path / "records"
    shutil.copytree(scoreboard.RECORDS, records)
    pas = json.loads((records / "pas.json").read_text())
    pas["conditions"][0].update(metric=metric, **condition)
    pas["reason"] = "a measured cause, as every failure carries (here: a test's)"
    (records / "pas.json").write_text(json.dumps(pas))
    return records


def test_figures_mode_fills_a_record_from_room_table_json(tmp_path):
    """room_table.py's paired Δ (points) becomes the condition's figure, with the interval
    room_table prints (bounded to ±100 points), and the page renders from it."""
    records = _room_record(tmp_path, "room_delta")
    figures = tmp_path / "pas.json"
    entry = {"reference": "strategy=fedavg", "seeds": ["0", "1", "2"], "deltas": [2.0, 3.0, 4.0]}
    figures.write_text(json.dumps({"budget_s": {}, "arms": {"strategy=pas": entry}}))
    record = scoreboard.record_figures([figures], "pas", "room_table ...", "2026-12-06", records)
    (c,) = record["conditions"]
    assert c["seeds"] == [2.0, 3.0, 4.0]
    assert (c["mean"], c["lo"], c["hi"]) == interval([2.0, 3.0, 4.0], bounds=(-100.0, 100.0))
    assert verdict(record) == REPRODUCES  # [0.52, 5.48] lies above the bar 0
    assert record["source"]["figures"] == str(figures)
    assert "**3.00** [0.52, 5.48]" in render(load_records(records))
    entry["reference"] = "strategy=adacomm"  # paired with another arm: not this condition's
    figures.write_text(json.dumps({"arms": {"strategy=pas": entry}}))
    with pytest.raises(RecordError, match="no figures pair 'strategy=pas' with 'strategy=fedavg'"):
        scoreboard.record_figures([figures], "pas", "cmd", "2026-12-06", records)
    for malformed in ({"arms": ["strategy=pas"]}, ["arms"], {"arms": {"strategy=pas": 3}}):
        figures.write_text(json.dumps(malformed))
        with pytest.raises(RecordError, match="no figures pair"):
            scoreboard.record_figures([figures], "pas", "cmd", "2026-12-06", records)
    entry |= {"reference": "strategy=fedavg", "deltas": [2.0, "3", 4.0]}
    figures.write_text(json.dumps({"arms": {"strategy=pas": entry}}))
    with pytest.raises(RecordError, match="not numbers within"):
        scoreboard.record_figures([figures], "pas", "cmd", "2026-12-06", records)


def test_a_missed_target_keeps_a_figure_to_it_from_reproducing(tmp_path):
    records = _room_record(tmp_path, "room_to_target", rule="at_most", bar=0.6)
    figures = tmp_path / "apf.json"
    arm = {"seeds": ["0", "1"], "ratios": [0.40, 0.42], "missed": ["2"]}
    figures.write_text(json.dumps({"reference": "strategy=fedavg", "arms": {"strategy=pas": arm}}))
    record = scoreboard.record_figures([figures], "pas", "cmd", "2026-12-06", records)
    (c,) = record["conditions"]
    assert c["missed"] == 1 and c["hi"] < 0.6  # below the bar on the seeds that reached it
    assert condition_verdict(c) == INCONCLUSIVE  # ... but seed 2 never did
    assert "target missed on 1 seed:" in render(load_records(records))
    arm |= {"seeds": [], "ratios": [], "missed": ["0", "1", "2"]}
    figures.write_text(json.dumps({"reference": "strategy=fedavg", "arms": {"strategy=pas": arm}}))
    (c,) = scoreboard.record_figures([figures], "pas", "cmd", "2026-12-06", records)["conditions"]
    assert c["mean"] is None and condition_verdict(c) == FAILS
    assert "never reached" in render(load_records(records))


def test_figures_mode_reads_each_condition_from_the_file_that_holds_its_metric(tmp_path):
    """FedCA's record: time to target from one room_table.py file, accuracy from another,
    whichever order they are given in."""
    records = _room_record(tmp_path, "room_to_target", rule="at_most", bar=0.85)
    pas = json.loads((records / "pas.json").read_text())
    accuracy = pas["conditions"][0] | {"label": "Δ accuracy", "metric": "room_delta", "bar": -1.0}
    pas["conditions"].append(accuracy | {"rule": "at_least"})
    (records / "pas.json").write_text(json.dumps(pas))
    time = tmp_path / "time.json"
    ratios = {"seeds": ["0", "2"], "ratios": [0.9, 1.0], "missed": []}
    time.write_text(json.dumps({"reference": "strategy=fedavg", "arms": {"strategy=pas": ratios}}))
    deltas = {"reference": "strategy=fedavg", "seeds": ["0", "1"], "deltas": [1.0, 2.0]}
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"arms": {"strategy=pas": deltas}}))
    for order in ([time, acc], [acc, time]):
        record = scoreboard.record_figures(order, "pas", "cmd", "2026-12-06", records)
        assert [c["seeds"] for c in record["conditions"]] == [[0.9, 1.0], [1.0, 2.0]]
    acc.write_text(json.dumps({"arms": {"strategy=pas": deltas | {"deltas": [1.0, None]}}}))
    with pytest.raises(RecordError, match="not numbers within"):
        scoreboard.record_figures([time, acc], "pas", "cmd", "2026-12-06", records)
