"""Comparison tables of several runs: traffic relative to the reference arm."""

from __future__ import annotations

import json

from fl.compare import compare_runs


def _fake_run(path, label: str, total_up: int, payload_up: int, frozen=None):
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(f"- {label}\n- experiment=x\n")
    rows = []
    for rnd in (1, 2):
        row = {
            "round": rnd,
            "accuracy": 0.5 * rnd,
            "cum_bytes_up": total_up * rnd // 2,
            "cum_bytes_down": 0,
            "virtual_time_s": float(rnd),
        }
        if frozen is not None:
            row["frozen_fraction"] = frozen
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "final_accuracy": 1.0,
        "best_accuracy": 1.0,
        "total_bytes_up": total_up,
        "total_bytes_down": 0,
        "total_payload_bytes_up": payload_up,
        "total_payload_bytes_down": 0,
        "virtual_time_s": 2.0,
    }
    (path / "summary.json").write_text(json.dumps(summary))


def test_table_reports_traffic_relative_to_first_run(tmp_path):
    _fake_run(tmp_path / "0", "strategy=fedavg", 4_000_000, 4_000_000)
    _fake_run(tmp_path / "1", "strategy=apf", 1_100_000, 1_000_000, frozen=0.75)
    table = compare_runs([tmp_path / "0", tmp_path / "1"], tmp_path, "t")
    fedavg, apf = table.splitlines()[2:4]
    assert fedavg.startswith("| strategy=fedavg |") and "| 100.0% |" in fedavg
    assert "| 1.1 | 27.5% | 1.0 | 25.0% |" in apf
    assert apf.endswith("| 0.750 |") and fedavg.endswith("| - |")
    for name in ("comparison.md", "comparison.png", "frozen_fraction.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_table_reports_rounds_and_traffic_to_target(tmp_path):
    _fake_run(tmp_path / "0", "strategy=fedavg", 4_000_000, 4_000_000)
    _fake_run(tmp_path / "1", "strategy=apf", 1_100_000, 1_000_000)
    for name, rounds, hit in (("0", 2, 4_000_000), ("1", None, None)):
        path = tmp_path / name / "summary.json"
        summary = json.loads(path.read_text())
        summary |= {"target_accuracy": 0.9, "rounds_to_target": rounds, "bytes_to_target": hit}
        path.write_text(json.dumps(summary))
    table = compare_runs([tmp_path / "0", tmp_path / "1"], tmp_path, "t")
    header, _, fedavg, apf = table.splitlines()[:4]
    assert "| rounds to 0.9 | MB to 0.9 |" in header
    assert "| 2 | 4.0 |" in fedavg and "| None | not reached |" in apf
