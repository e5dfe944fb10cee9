"""The cluster client deployed as docs/DEPLOYMENT.md §15 says, with the gRPC side channel.

A real SuperLink and two SuperNodes on 127.0.0.1; the App's ClientApp component is
`clients.cluster:app` (step 1), and SuperNode 0 is a cluster of 2 gloo ranks that rank 0
starts each round, rank 1 emulated 3x slower (step 2a). `fl-run engine=deployment
transport=grpc` with every ArrayRecord aside: the model must travel beside Flower's
messages to and from the cluster node, and the run must be a one-process run's.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO, read_metrics
from federation import TWO_ROUNDS, Federation, app_copy, local_rows, submit
from flwr.common.config import parse_config_args

from clients.ranks import ClusterConfig

# Step 2a's node config, strings quoted as Flower's `--node-config` parser requires.
CLUSTER = 'cluster-ranks=2 cluster-backend="gloo" cluster-slowdown="1,3"'
JOB = (*TWO_ROUNDS, "plots=false")  # digits, 2 clients, 2 rounds
BULK = ("transport=grpc", "transport.min_bytes=1")  # every ArrayRecord goes aside


def test_the_documented_node_configs_parse_as_flower_supernode_parses_them():
    text = (REPO / "docs" / "DEPLOYMENT.md").read_text()
    section = text.split("## 15. Cluster clients", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"--node-config\s*(?:\\\n)?\s*'([^']*)'", section)
    assert len(documented) == 3, documented  # 2a: GPU and CPU nodes; 2b: rank 0's node
    for pairs in [*documented, CLUSTER]:
        config = ClusterConfig.from_node_config(parse_config_args([pairs]))  # ClickException
        assert config is not None and config.ranks >= 2, pairs


@pytest.mark.slow  # 3.5-6.5 min at load 5-14 on 2 cores: a deployment, a rank started a round
@pytest.mark.integration
def test_a_deployed_cluster_client_trains_over_the_side_channel_as_one_process(tmp_path):
    app = app_copy(tmp_path / "app", "clients.cluster:app")
    fed = Federation(tmp_path / "federation")
    # the reference (one process per client, inline, engine=local) runs meanwhile: the
    # deployment mostly waits (process starts, Flower's polling)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(local_rows, *JOB)
        try:
            fed.start_superlink("--insecure")
            fed.start_supernode(0, 2, "--insecure", node_config=CLUSTER)
            fed.start_supernode(1, 2, "--insecure")
            # (4-6.5 min on 2 shared cores at load 7-14: a cluster round starts 2 processes)
            proc = submit(fed, tmp_path / "run", *JOB, *BULK, app=app, timeout=600)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + fed.logs()
            cluster_log = (fed.root / "supernode0.log").read_text()
        finally:
            fed.stop()
        local = reference.result()
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["replies"] == 2 and r["failed"] == 0 and r["rejected"] == 0 for r in rows)
    # both nodes' instructions and replies went aside, none fell back to inline
    assert [(r["bulk_down"], r["bulk_up"], r["bulk_fallbacks"]) for r in rows] == [(2, 2, 0)] * 2
    for ours, alone in zip(rows, local, strict=True):
        assert ours["accuracy"] == pytest.approx(alone["accuracy"], abs=1e-9)
        assert ours["loss"] == pytest.approx(alone["loss"], rel=1e-5)
        for key in ("bytes_up", "bytes_down", "payload_bytes_up", "payload_bytes_down"):
            assert ours[key] == alone[key], key
    # rank 0's line in the SuperNode's log, once a round: the rounds ran on the cluster
    assert cluster_log.count("on 2 gloo ranks (cpu)") == 2, cluster_log[-3000:]
