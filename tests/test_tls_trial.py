"""docs/DEPLOYMENT.md section 9's one-machine block, run verbatim: a TLS SuperLink with node
authentication behind the gate, two registered SuperNodes, a run only they may train."""

from __future__ import annotations

import re

import pytest
from conftest import read_metrics
from federation import TWO_ROUNDS, local_rows
from netns import require_netns
from test_flwr_run import DOC, _bash_in_netns

SECTION = "## 9. TLS, SuperNode authentication, and a Control API only the operator reaches"


def _tls_trial() -> str:
    """The shell block under "All of it on one machine" in section 9, as written there."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    trial = section.split("**All of it on one machine**", 1)[1]
    return re.findall(r"```bash\n(.*?)```", trial, re.DOTALL)[0]


def test_the_block_submits_the_two_round_run_to_the_registered_nodes_only():
    block = _tls_trial()
    assert "--enable-supernode-auth" in block and "engine.insecure=false" in block
    assert " ".join(TWO_ROUNDS) in block and '"$(tail -n 1 certs.txt)"' in block
    assert block.count("flwr supernode register") == 2


@pytest.mark.slow  # about 2 min: certificates, a TLS SuperLink, the gate, two nodes, 2 rounds
@pytest.mark.integration
def test_the_tls_trial_in_the_docs_works_verbatim(tmp_path):
    require_netns()
    proc = _bash_in_netns(_tls_trial(), tmp_path, timeout=400, TMPDIR=str(tmp_path))
    [trial] = [d for d in tmp_path.glob("tmp.*") if d.is_dir()]  # its `mktemp -d` folder
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in trial.glob("*.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    assert "completed; outputs in" in proc.stdout, proc.stdout[-3000:] + logs
    assert proc.stdout.count("registered") >= 2  # both keys, by `flwr supernode register`
    [run_dir] = [p.parent for p in trial.glob("outputs/*/*/metrics.jsonl")]
    rows = read_metrics(run_dir)
    assert all(r["replies"] == 2 and r["failed"] == 0 and r["rejected"] == 0 for r in rows)
    local = local_rows(*TWO_ROUNDS)
    for key in ("accuracy", "loss", "bytes_up", "bytes_down"):
        assert [r[key] for r in rows] == [r[key] for r in local], key
