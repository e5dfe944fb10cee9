"""experiments/room_table.py: paired Δ accuracy by seed, at equal rounds or at equal virtual
time, from run folders written here; bad metrics are refused, not averaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments import room_table


def _run(
    sweep: Path, job: int, arm: str, seed: int, rows: list[tuple[float, float]], per_round: int = 0
) -> None:
    """A finished run: its overrides, one metrics row per (virtual time, accuracy), each
    round sending `per_round` bytes up and as many down."""
    folder = sweep / str(job)
    (folder / ".hydra").mkdir(parents=True)
    overrides = [arm, f"seed={seed}", "experiment=gift_room"]
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    lines = [
        json.dumps(
            {
                "round": r + 1,
                "virtual_time_s": t,
                "accuracy": a,
                "cum_bytes_up": per_round * (r + 1),
                "cum_bytes_down": per_round * (r + 1),
            }
        )
        for r, (t, a) in enumerate(rows)
    ]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "summary.json").write_text(json.dumps({"final_accuracy": rows[-1][1]}))


def _sweep(tmp_path: Path) -> Path:
    """Two seeds; FedAvg's rounds take 2 s, GIFT's 1 s; GIFT's accuracy runs 1 point higher
    at equal rounds and FedAvg's own figure, at GIFT's end (T = 10 s), is its round 5."""
    sweep = tmp_path / "sweep"
    job = 0
    for seed in (0, 1):
        base = 0.5 + 0.01 * seed
        fedavg = [(2.0 * (r + 1), base + 0.01 * r) for r in range(10)]
        gift = [(1.0 * (r + 1), base + 0.01 * r + 0.01) for r in range(10)]
        for arm, rows in (("strategy=fedavg", fedavg), ("strategy=gift", gift)):
            _run(sweep, job, arm, seed, rows)
            job += 1
    return sweep


def test_equal_rounds_and_equal_time(tmp_path):
    sweep = _sweep(tmp_path)
    arms = room_table.seed_arms(room_table.find_runs(sweep))
    rounds = room_table.paired(arms, "strategy=fedavg", 2, equal_time=False)
    assert rounds["arms"]["strategy=gift"]["deltas"] == pytest.approx([1.0, 1.0])
    timed = room_table.paired(arms, "strategy=fedavg", 2, equal_time=True)
    assert timed["budget_s"] == {"0": 10.0, "1": 10.0}
    # by 10 s GIFT has run all 10 rounds (mean of rounds 9-10), FedAvg 5 (rounds 4-5)
    assert timed["arms"]["strategy=gift"]["deltas"] == pytest.approx([6.0, 6.0])
    figure = timed["arms"]["strategy=gift"]
    assert figure["lo"] == pytest.approx(6.0) and figure["hi"] == pytest.approx(6.0)
    assert room_table.verdict(figure["lo"], figure["hi"], 0.0) == "reproduces"
    assert room_table.verdict(-1.0, 2.0, 0.0) == "inconclusive"
    assert room_table.verdict(-3.0, -1.0, 0.0) == "does not reproduce"


def test_the_command_prints_and_writes_json(tmp_path, capsys):
    sweep, out = _sweep(tmp_path), tmp_path / "figures.json"
    args = [str(sweep), "--reference", "strategy=fedavg", "--window", "2", "--equal-time"]
    assert room_table.main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| strategy=gift − strategy=fedavg | 0,1 | +6.00 [+6.00, +6.00]" in printed
    assert json.loads(out.read_text())["arms"]["strategy=gift"]["seeds"] == ["0", "1"]


def test_a_seed_read_twice_is_refused_not_counted_twice(tmp_path, capsys):
    sweep, out = _sweep(tmp_path), tmp_path / "figures.json"
    args = [str(sweep), str(sweep), "--reference", "strategy=fedavg", "--window", "2"]
    assert room_table.main([*args, "--json", str(out)]) == 2
    assert "'strategy=fedavg' ran seed 0 twice" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "bad",
    [(4.0, float("nan")), (4.0, 1.5), (1.0, 0.5)],  # not finite, above 1, time going back
    ids=["nan", "above-one", "time-back"],
)
def test_bad_metrics_are_refused(tmp_path, bad):
    sweep = _sweep(tmp_path)
    path = sweep / "1" / "metrics.jsonl"  # GIFT, seed 0
    rows = path.read_text().splitlines()
    rows[3] = json.dumps({"round": 4, "virtual_time_s": bad[0], "accuracy": bad[1]})
    path.write_text("\n".join(rows) + "\n")
    arms = room_table.seed_arms(room_table.find_runs(sweep))
    with pytest.raises(ValueError, match="run 1"):
        room_table.paired(arms, "strategy=fedavg", 2, equal_time=True)


def test_too_few_rounds_by_the_budget_is_an_error(tmp_path):
    arms = room_table.seed_arms(room_table.find_runs(_sweep(tmp_path)))
    with pytest.raises(ValueError, match="need 6"):  # FedAvg has 5 rounds by 10 s
        room_table.paired(arms, "strategy=fedavg", 6, equal_time=True)
    with pytest.raises(ValueError, match="no arm"):
        room_table.paired(arms, "strategy=pas", 2, equal_time=False)


def _grafts(tmp_path: Path) -> Path:
    """Three seeds of an original and its graft over 10 rounds of 1 s: the graft sends 0.6×
    the original's bytes and ends 1 point below it (seed 2: 3 below)."""
    sweep, job = tmp_path / "grafts", 0
    for seed in (0, 1, 2):
        original = [(r + 1.0, 0.5 + 0.01 * r) for r in range(10)]
        drop = 0.03 if seed == 2 else 0.01
        graft = [(t, a - drop) for t, a in original]
        for arm, rows, sent in (("strategy=apf", original, 100), ("strategy=graft_apf", graft, 60)):
            _run(sweep, job, arm, seed, rows, per_round=sent)
            job += 1
    return sweep


def test_a_pair_with_its_own_reference_and_its_bytes(tmp_path, capsys):
    arms = room_table.seed_arms(room_table.find_runs(_grafts(tmp_path)))
    pairs = [("strategy=graft_apf", "strategy=apf")]
    result = room_table.paired(arms, None, 2, equal_time=False, pairs=pairs, sent=True)
    graft = result["arms"]["strategy=graft_apf"]
    assert graft["reference"] == "strategy=apf"
    assert graft["deltas"] == pytest.approx([-1.0, -1.0, -3.0])
    assert graft["bytes"]["ratios"] == pytest.approx([0.6, 0.6, 0.6])
    assert room_table.ratio_verdict(graft["bytes"], 1.0) == "reproduces"
    assert room_table.ratio_verdict(graft["bytes"], 0.5) == "does not reproduce"
    args = [str(tmp_path / "grafts"), "--pair", *pairs[0], "--window", "2", "--bytes"]
    assert room_table.main([*args, "--bar", "-1"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith("| strategy=graft_apf − strategy=apf | 0,1,2 | -1.67 [")
    assert row.endswith("| 0.60 [0.60, 0.60] | 0.600 / 0.600 / 0.600 | reproduces |")


def test_an_arm_a_resumed_sweep_started_pairs_with_the_others(tmp_path, capsys):
    sweep = _grafts(tmp_path)
    saved = sweep / "5" / ".hydra" / "overrides.yaml"  # graft_apf, seed 2
    saved.write_text(yaml.safe_dump([*yaml.safe_load(saved.read_text()), "resume=true"]))
    args = [str(sweep), "--pair", "strategy=graft_apf", "strategy=apf", "--window", "2"]
    assert room_table.main(args) == 0
    assert "| strategy=graft_apf − strategy=apf | 0,1,2 |" in capsys.readouterr().out


def test_a_missing_arm_is_one_line(tmp_path, capsys):
    args = [str(_grafts(tmp_path)), "--pair", "strategy=graft_gift", "strategy=gift"]
    assert room_table.main(args) == 2
    assert capsys.readouterr().err.startswith("room_table: no arm 'strategy=graft_gift'")


def test_bytes_to_target(tmp_path):
    """The target is the reference's last-2 mean (0.585) minus 1 point: 0.575, which the
    original reaches at its round 9 (0.58) and the graft (1 point lower) at round 10, except
    on seed 2 (3 points lower: never)."""
    arms = room_table.seed_arms(room_table.find_runs(_grafts(tmp_path)))
    result = room_table.to_target(arms, "strategy=apf", 2, margin=1.0, reach=1)
    assert result["target"] == pytest.approx(0.575)
    graft = result["arms"]["strategy=graft_apf"]
    assert graft["seeds"] == ["0", "1"] and graft["missed"] == ["2"]
    assert graft["ratios"] == pytest.approx([0.6 * 10 / 9] * 2)
    # 0.667 < 1 on every seed that reached it, but one seed missed: not "reproduces"
    assert room_table.ratio_verdict(graft, 1.0) == "inconclusive"
    assert room_table.ratio_verdict({**graft, "missed": ["2", "3", "4"]}, 1.0) == (
        "does not reproduce"
    )
    assert room_table.ratio_verdict({**graft, "missed": []}, 1.0) == "reproduces"
    # by a 3-round trailing mean the original reaches 0.575 at round 10, the graft never
    trailing = room_table.to_target(arms, "strategy=apf", 2, margin=1.0, reach=3)
    graft = trailing["arms"]["strategy=graft_apf"]
    assert graft["missed"] == ["0", "1", "2"] and graft["ratios"] == []
    assert room_table.ratio_verdict(graft, 1.0) == "does not reproduce"
    # the same reach read as virtual time (1 s a round): 10 s against 9 s
    timed = room_table.to_target(arms, "strategy=apf", 2, margin=1.0, reach=1, measure="time")
    assert timed["arms"]["strategy=graft_apf"]["ratios"] == pytest.approx([10 / 9] * 2)
    with pytest.raises(ValueError, match="measure is one of"):
        room_table.to_target(arms, "strategy=apf", 2, margin=1.0, reach=1, measure="rounds")


def test_bytes_that_go_back_are_refused(tmp_path):
    sweep = _grafts(tmp_path)
    path = sweep / "1" / "metrics.jsonl"  # the graft, seed 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[5]["cum_bytes_up"] = 0
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    arms = room_table.seed_arms(room_table.find_runs(sweep))
    with pytest.raises(ValueError, match="run 1: round 6's bytes go back"):
        room_table.to_target(arms, "strategy=apf", 2, margin=1.0, reach=5)
