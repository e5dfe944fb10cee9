"""engine=flower-sim across a two-node Ray cluster (RAY_ADDRESS), gives the local engine's numbers.

The head and a worker node, each with one CPU of its own, run in a network namespace
that has only loopback (so Ray cannot listen anywhere else; every socket is checked) and
in a PID namespace of their own (so every Ray process ends with the test, and no `ray
stop` can touch another job's Ray). fl-run joins the cluster through RAY_ADDRESS, as in
docs/SCALE.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import OFFLINE, REPO, fl_env, fl_run_cmd, read_metrics, run_fl
from netns import require_netns

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two Ray starts: about a minute

RUN = ["num_clients=4", "clients_per_round=4", "rounds=2", "task=digits", "local_epochs=1"]
PORT = 6390
RAY = str(Path(sys.executable).parent / "ray")
LOOPBACK = {"127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"}  # as `ss` shows local addresses
NODE = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats"]

# Runs inside the namespaces: start the cluster, record its sockets, run fl-run on it,
# then list its nodes and where the ClientApp actors ran.
CLUSTER = """
set -u
ip link set lo up
"$RAY" start --head --port=$PORT $NODE --resources='{"head": 1}' --include-dashboard=false \
    --temp-dir="$RAY_TMP" > "$LOGS/head.log" 2>&1 || exit 10
"$RAY" start --address=127.0.0.1:$PORT $NODE --resources='{"worker": 1}' \
    > "$LOGS/worker.log" 2>&1 || exit 11
ss -H -ltnu > "$LOGS/listening.txt"
RAY_ADDRESS=127.0.0.1:$PORT "$@" > "$LOGS/fl-run.log" 2>&1
echo $? > "$LOGS/fl-run.rc"
"$PYTHON" -c "$SURVEY" > "$LOGS/cluster.json" 2> "$LOGS/survey.log"
"""
SURVEY = """
import json, os, ray
from ray._private import state
ray.init(address=os.environ["CLUSTER"], logging_level="ERROR")
nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
actors = [
    a["Address"]["NodeID"] for a in state.actors().values()
    if a["ActorClassName"] == "ClientAppActor"
]
print(json.dumps({"nodes": nodes, "actor_nodes": actors}))
"""


def _namespaces() -> list[str]:
    """A new network, PID and mount namespace (unprivileged: inside a user namespace)."""
    user = [] if os.geteuid() == 0 else ["-r"]
    return ["unshare", *user, "-n", "-p", "-f", "--mount-proc"]


def test_flower_sim_on_a_two_node_ray_cluster_matches_the_local_engine(tmp_path):
    require_netns()
    if shutil.which("ss") is None:
        pytest.skip("needs `ss` (iproute2) to list the cluster's sockets")
    logs = tmp_path / "logs"
    logs.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    env = {
        **fl_env(),
        **OFFLINE,
        "RAY": RAY,
        "PORT": str(PORT),
        "NODE": " ".join(NODE),
        "RAY_TMP": ray_tmp,
        "LOGS": str(logs),
        "PYTHON": sys.executable,
        "SURVEY": SURVEY,
        "CLUSTER": f"127.0.0.1:{PORT}",
    }
    fl_run = fl_run_cmd(f"hydra.run.dir={tmp_path / 'cluster'}", "engine=flower-sim", *RUN)
    try:
        proc = subprocess.run(
            [*_namespaces(), "sh", "-c", CLUSTER, "sh", *fl_run],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,  # two Ray starts: about a minute idle, several on a busy machine
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    shown = {p.name: p.read_text()[-2000:] for p in logs.iterdir()}
    assert proc.returncode == 0 and (logs / "fl-run.rc").read_text().strip() == "0", shown

    # Ray listened on loopback only
    sockets = (logs / "listening.txt").read_text().split("\n")
    local = [line.split()[4] for line in sockets if line.strip()]
    assert local and all(a.rsplit(":", 1)[0] in LOOPBACK for a in local), local
    # two nodes, each with its own CPU, and the ClientApp ran on both
    cluster = json.loads((logs / "cluster.json").read_text())
    assert sorted(n.get("head", 0) + 2 * n.get("worker", 0) for n in cluster["nodes"]) == [1, 2]
    assert all(n["CPU"] == 1 for n in cluster["nodes"])
    assert len(set(cluster["actor_nodes"])) == 2

    # the same seeded job on the local engine: the same numbers, bit for bit
    run_fl(tmp_path / "local", *RUN, "engine=local")
    on_cluster, local = read_metrics(tmp_path / "cluster"), read_metrics(tmp_path / "local")
    assert [r["round"] for r in on_cluster] == [1, 2]
    for key in ("accuracy", "loss", "bytes_up", "bytes_down", "virtual_time_s", "replies"):
        assert [r[key] for r in on_cluster] == [r[key] for r in local], key
