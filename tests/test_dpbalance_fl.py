"""A DPBalance-scheduled FL pipeline: granted by the ledger, charged per round, stopped at grant."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fl_run_cmd, python_popen, python_run, read_metrics

from fl.common.config import compose
from fl.world.task import get_task
from privacy.ledger import Ledger
from privacy.rounds import RoundPrivacy

RUN = ["experiment=dpbalance", "num_clients=4", "clients_per_round=2", "rounds=6"]


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two pipelines, each on its own ledger, run at once: one within its grant, one greedy."""
    root = tmp_path_factory.mktemp("dpbalance")
    jobs = {
        "jobA": [],
        "greedy": ["privacy.ledger.noise_from_grant=false", "privacy.noise_multiplier=1.3"],
    }
    procs = {
        name: python_popen(
            fl_run_cmd(
                f"hydra.run.dir={root / name}",
                *RUN,
                f"privacy.ledger.path={root / name / 'ledger.sqlite'}",
                *extra,
            ),
            capture=False,
        )
        for name, extra in jobs.items()
    }
    for proc in procs.values():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return root


def test_a_pipeline_spends_its_grant_round_by_round(runs, tmp_path):
    ledger_path = runs / "jobA" / "ledger.sqlite"
    summary = _summary(runs / "jobA")
    assert summary["stopped"] is None and summary["rounds"] == 6
    assert summary["ledger"]["granted_epsilon"] == pytest.approx(2.5)  # κ = 1.25 x demand 2.0
    final = {int(p): e for p, e in summary["epsilon_per_client"].items()}
    assert 0 < max(final.values()) <= 2.5  # σ was sized from the grant
    pipeline = summary["ledger"]["pipeline"]
    assert pipeline.startswith("jobA-") and len(pipeline) == len("jobA-") + 12  # a fresh id
    with Ledger(ledger_path) as ledger:
        assert ledger.check() == []
        record = ledger.pipeline(pipeline)
        assert record.status == "finished" and record.kappa == pytest.approx(1.25)
        assert record.lease_until is None  # finished: the lease ended with the run
        for p in range(4):  # charges, summed, are exactly each client's Opacus ε
            assert record.spent[f"digits/client-{p}"] == pytest.approx(final.get(p, 0.0), rel=1e-9)
            # δ composes by addition: each client that took part spent the run's δ once
            assert record.delta_spent[f"digits/client-{p}"] == (1e-5 if p in final else 0.0)
        rounds = ledger.db.execute(
            "SELECT round, COUNT(*) FROM charges WHERE pipeline = ? GROUP BY round", (pipeline,)
        ).fetchall()
        assert rounds == [(r, 2) for r in range(1, 7)]  # the 2 selected clients, every round
        # finished: what it did not spend went back to the blocks
        assert ledger.blocks()["digits/client-0"][1] == pytest.approx(final.get(0, 0.0))
        assert ledger.delta_blocks()["digits/client-0"] == (1e-4, 1e-5 if 0 in final else 0.0)

    # the same pipeline id again (not a resume) would restart its clients' accountants
    cfg = compose(
        [*RUN, f"privacy.ledger.path={ledger_path}", f"privacy.ledger.pipeline={pipeline}"]
    )
    again = RoundPrivacy(cfg, get_task(cfg), tmp_path / "again")
    assert f"already exists in ledger {ledger_path} (finished)" in again.start()
    assert again.grant == {} and again.train_config() == {}
    with Ledger(ledger_path) as ledger:
        assert ledger.check() == [] and ledger.pipeline(pipeline).status == "finished"


def test_a_pipeline_that_would_overspend_stops_and_keeps_its_model(runs):
    run_dir = runs / "greedy"
    ledger_path = run_dir / "ledger.sqlite"
    summary = _summary(run_dir)
    assert summary["rounds"] == 3
    assert "would spend ε=" in summary["stopped"]
    assert (
        "above its grant of 2.5; stopped before round 4, the model of round 3 is kept"
        in (summary["stopped"])
    )
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2, 3]
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    model = torch.load(run_dir / "model.pt")
    assert saved["progress"]["round"] == 3
    assert all(torch.equal(model[k], saved["arrays"][k]) for k in model)
    with Ledger(ledger_path) as ledger:
        assert ledger.check() == []
        record = ledger.pipeline(summary["ledger"]["pipeline"])
        assert record.status == "stopped" and "stopped before round 4" in record.note
        assert max(record.spent.values()) <= 2.5


def test_fl_run_refuses_to_grant_on_a_tampered_ledger(tmp_path):
    ledger_path = tmp_path / "ledger.sqlite"
    with Ledger(ledger_path) as ledger:
        ledger.add_blocks({"digits/client-0": 5.0})
        ledger.db.execute("UPDATE blocks SET allocated = 1.0")  # past the triggers, by hand
    proc = python_run(
        fl_run_cmd(f"hydra.run.dir={tmp_path / 'run'}", *RUN, f"privacy.ledger.path={ledger_path}")
    )
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[-1].startswith(
        f"fl-run: privacy budget: ledger {ledger_path} is inconsistent "
        "(block digits/client-0: allocated 1.0 != sum of grants 0): refusing to grant"
    )
    assert "Traceback" not in proc.stderr
    # refused before round 1: no untrained model, nothing that looks like a run
    assert not (tmp_path / "run" / "model.pt").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with Ledger(ledger_path) as ledger:
        assert ledger.db.execute("SELECT COUNT(*) FROM pipelines").fetchone()[0] == 0
