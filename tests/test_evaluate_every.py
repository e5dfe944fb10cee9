"""`evaluate_every`: the global model is tested every N rounds and on the run's last round;
training, traffic and the clock are those of a run tested every round."""

from __future__ import annotations

import json
import re

import pytest
from conftest import train_in_process, without_wall_time

from fl.common.config import ConfigError, compose
from fl.run.tracking import reached_target, summarize
from fl.run.validation import validate

RUN = ["num_clients=6", "clients_per_round=4", "local_epochs=1", "system=heterogeneous"]
SCORES = ("accuracy", "loss")


def _unscored(rows):
    return [{k: v for k, v in r.items() if k not in SCORES} for r in without_wall_time(rows)]


def test_rounds_between_evaluations_train_alike_and_carry_no_scores(tmp_path):
    every_round, _ = train_in_process(tmp_path / "one", *RUN, "rounds=7")
    sparse, _ = train_in_process(tmp_path / "three", *RUN, "rounds=7", "evaluate_every=3")
    assert _unscored(sparse) == _unscored(every_round)  # the same training, bytes and clock
    assert [r["round"] for r in sparse if "accuracy" in r] == [3, 6, 7]  # 7: the last
    for mine, full in zip(sparse, every_round, strict=True):
        if "accuracy" in mine:
            assert (mine["accuracy"], mine["loss"]) == (full["accuracy"], full["loss"])
        else:
            assert "loss" not in mine
    assert (tmp_path / "three" / "accuracy.png").read_bytes()[:4] == b"\x89PNG"  # tested rows
    summary = json.loads((tmp_path / "three" / "summary.json").read_text())
    assert summary["rounds"] == 7
    assert summary["final_accuracy"] == every_round[-1]["accuracy"]
    assert summary["best_accuracy"] == max(every_round[r - 1]["accuracy"] for r in (3, 6, 7))


def test_a_time_budget_ends_on_an_evaluated_round(tmp_path):
    full, _ = train_in_process(tmp_path / "full", *RUN, "rounds=5")
    budget = (full[1]["virtual_time_s"] + full[2]["virtual_time_s"]) / 2  # inside round 3
    rows, _ = train_in_process(
        tmp_path / "cut", *RUN, "rounds=5", "evaluate_every=4", f"time_budget_s={budget}"
    )
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["round"] for r in rows if "accuracy" in r] == [3]
    assert rows[-1]["accuracy"] == full[2]["accuracy"]


def test_targets_and_summaries_count_evaluated_rounds_only():
    rows = [
        {"round": 1, "accuracy": 0.2, "loss": 2.0},
        {"round": 2},  # not evaluated: no accuracy to read
        {"round": 3, "accuracy": 0.6, "loss": 1.0},
        {"round": 4},
        {"round": 5, "accuracy": 0.5, "loss": 1.1},
    ]
    for row in rows:
        row.update(cum_bytes_up=row["round"], cum_bytes_down=0, virtual_time_s=row["round"])
        row.update(cum_payload_bytes_up=0, cum_payload_bytes_down=0, wall_time_s=0.0)
    assert reached_target(rows, 0.35, window=2)["round"] == 3  # (0.2 + 0.6) / 2
    assert reached_target(rows, 0.5, window=2)["round"] == 5  # (0.6 + 0.5) / 2
    assert reached_target(rows, 0.56, window=2) is None
    summary = summarize(rows, 0.5, window=2)
    assert summary["final_accuracy"] == 0.5 and summary["best_accuracy"] == 0.6
    assert summary["rounds_to_target"] == 5 and summary["time_to_target_s"] == 5


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["evaluate_every=0"], "evaluate_every=0"),
        (["strategy=asfl", "evaluate_every=2"], "reads the global model's accuracy every round"),
    ],
)
def test_an_evaluation_interval_that_cannot_hold_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):  # by fl-run's checks, before round 1
        validate(compose(overrides))
