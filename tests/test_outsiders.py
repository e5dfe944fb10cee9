"""Outsiders holding only `ca.pem` cannot register, list or train; extra nodes are refused.

Without processes: the allow-list grid (`server.nodes.AllowedGrid`), the partition map's
refusals, the config key and the gate's path filter. With real processes, in two network
namespaces joined by a veth pair: namespace A holds the SuperLink (127.0.0.1 only, TLS,
node authentication), `fl.net.gate` on A's veth address (the Fleet API and nothing else), the
operator's `flwr` CLI, `fl-run` and the SuperNodes; namespace B holds an outsider with
`ca.pem` and a key of its own, reaching A only through the veth pair.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import read_metrics
from federation import TWO_ROUNDS, Federation, Wrap, flwr_cli, local_rows, netns_pair, submit
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=E0611
from flwr.supercore.primitives.asymmetric import public_key_to_bytes

from fl.common.config import ConfigError, compose
from fl.net.gate import is_forwarded
from fl.net.tls import fingerprint, make_node_key, write_bundle, write_node_key
from fl.run.engines.local import LocalGrid
from fl.run.validation import validate
from server.nodes import (
    AllowedGrid,
    FederationError,
    allowed_nodes,
    discover_partitions,
    wait_for_nodes,
)

REFUSED = "Exit Code: 305"  # flwr's SUPERNODE_CONNECTION_ERROR, logged before the node exits
RECEIVING = "Receiving:"  # a SuperNode's log line for every message it gets

# ----- the allow-list and the partition map, without Flower's processes ----------------------


def _grid(reported: list[int | str], seen: list[tuple[int, str]]) -> LocalGrid:
    """len(reported) nodes; node i says it holds partition reported[i]; every message any
    node gets is recorded in `seen` as (node id, message type)."""
    app = ClientApp()

    @app.query("info")
    def info(msg: Message, context: Context) -> Message:
        seen.append((context.node_id, msg.metadata.message_type))
        held = reported[int(context.node_config["partition-id"])]
        return Message(RecordDict({"info": ConfigRecord({"partition-id": held})}), reply_to=msg)

    return LocalGrid(app, len(reported), {})


def test_nodes_off_the_allow_list_are_never_counted_asked_or_sent_work(caplog):
    seen: list[tuple[int, str]] = []
    grid = _grid([0, 1, 0], seen)
    first, second, extra = grid.nodes.by_partition  # partitions 0, 1 and a second 0
    allowed = AllowedGrid(grid, frozenset({first, second}))
    with caplog.at_level(logging.WARNING, logger="server.nodes"):
        assert sorted(wait_for_nodes(allowed, 2, wait_s=1)) == sorted([first, second])
        assert discover_partitions(allowed, 2) == {first: 0, second: 1}
        allowed.get_node_ids()  # asked again every round: the refusal is logged once
    assert {node for node, _ in seen} == {first, second}
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals == [
        f"refused node {extra} (key none: node authentication is off): not on engine.allowed_nodes"
    ]
    with pytest.raises(FederationError, match="not on the allow-list"):
        allowed.push_messages([Message(RecordDict(), extra, "train")])
    # Too few allowed nodes is the usual shortfall, however many others connected.
    with pytest.raises(FederationError, match="only 1 of 2 nodes connected"):
        wait_for_nodes(AllowedGrid(grid, frozenset({first})), 2, wait_s=0.3)


def test_duplicate_out_of_range_or_malformed_claims_refuse_the_node_not_the_run(caplog):
    seen: list[tuple[int, str]] = []
    grid = _grid([0, 1, 0, 7, "1"], seen)
    ids = list(grid.nodes.by_partition)  # in partition order
    keeper = min(ids[0], ids[2])  # of two nodes claiming partition 0, the lower id keeps it
    dropped = max(ids[0], ids[2])
    with caplog.at_level(logging.WARNING, logger="server.nodes"):
        assert discover_partitions(grid, 2) == {keeper: 0, ids[1]: 1}
    logged = caplog.text
    assert f"refused node {dropped}: partition 0 is already held by node {keeper}" in logged
    assert f"refused node {ids[3]}: it holds partition 7, outside 0…1" in logged
    assert f"refused node {ids[4]}: its reply to the partition query is malformed" in logged
    # Only a partition nobody holds fails the run.
    with pytest.raises(FederationError, match=r"several nodes: \[0\], by none: \[1\]"):
        discover_partitions(_grid([0, 0], seen), 2)


class _KeyedGrid:
    """What AllowedGrid reads of a deployment's grid: nodes with their public keys."""

    def __init__(self, nodes: list[NodeInfo]) -> None:
        self.nodes = nodes

    def get_nodes(self) -> list[NodeInfo]:
        return self.nodes


def test_a_node_is_allowed_by_the_fingerprint_of_its_key(caplog):
    keys = [public_key_to_bytes(make_node_key().public_key()) for _ in range(2)]
    grid = _KeyedGrid(
        [NodeInfo(node_id=11, public_key=keys[0]), NodeInfo(node_id=12, public_key=keys[1])]
    )
    allowed = AllowedGrid(grid, frozenset({fingerprint(keys[0])}))
    with caplog.at_level(logging.WARNING, logger="server.nodes"):
        assert allowed.get_node_ids() == [11]
    assert f"refused node 12 (key {fingerprint(keys[1])})" in caplog.text


def test_the_allow_list_is_a_validated_deployment_key(tmp_path):
    write_node_key(tmp_path / "k")
    key = fingerprint((tmp_path / "k.pub").read_bytes())
    cfg = compose(["engine=deployment", f"engine.allowed_nodes=[6703112,{key}]"])
    validate(cfg)
    assert allowed_nodes(cfg) == frozenset({6703112, key})
    assert allowed_nodes(compose(["engine=deployment"])) is None
    for bad in ("[]", "[-1]", "[SHA256:abc]", "[true]", "6703112"):
        with pytest.raises(ConfigError, match=r"engine\.allowed_nodes"):
            validate(compose(["engine=deployment", f"engine.allowed_nodes={bad}"]))


@pytest.mark.parametrize(
    ("method", "path", "query", "passes"),
    [
        ("POST", b"/v1/fleet/pull-messages", b"", True),
        ("POST", b"/v1/fleet/register-node", b"", True),  # refused by node auth, not here
        ("GET", b"/health", b"", True),
        ("POST", b"/v1/control/list-runs", b"", False),
        ("POST", b"/v1/control/register-node", b"", False),
        ("POST", b"/v1/runtime/acquire-task", b"", False),
        ("POST", b"/v1/fleet/../control/list-runs", b"", False),
        ("POST", b"/v1/fleet/%2e%2e/control/start-run", b"", False),
        ("POST", b"/v1/fleet/pull-messages/", b"", False),
        ("POST", b"/v1/fleet/pull-messages", b"x=1", False),
        ("GET", b"/v1/fleet/pull-messages", b"", False),
        ("GET", b"/docs", b"", False),
        ("GET", b"/openapi.json", b"", False),
    ],
)
def test_the_gate_passes_fleet_calls_only(method, path, query, passes):
    assert is_forwarded(method, path, query) is passes


# ----- real processes: a walled federation and an outsider -----------------------------------


@dataclass
class Walled(Federation):
    """Namespace A's federation behind `fl.net.gate`; `outsider` runs things in namespace B."""

    outsider: Wrap | None = None
    public: str = ""  # A's veth address, the only one B can reach
    ids: dict[str, int] = field(default_factory=dict)  # node key name -> registered node id
    stray: subprocess.Popen[bytes] | None = None  # the outsider's SuperNode

    def in_b(self, cmd: list[str]) -> list[str]:
        assert self.outsider is not None
        return self.outsider(cmd)

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    def admin(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The operator: `flwr` on the SuperLink's machine, to its loopback Control API."""
        return self.flwr(*args, ca=self.certs / "ca.pem")

    def stranger(self, address: str, *args: str) -> subprocess.CompletedProcess[str]:
        """The outsider's `flwr`, trusting the CA, dialling `address` from namespace B."""
        home = self.root / "stranger-cli"
        return flwr_cli(home, address, self.root / "stranger" / "ca.pem", *args, wrap=self.in_b)


def _json(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def _succeeded(proc: subprocess.CompletedProcess[str]) -> bool:
    """A `flwr … --format json` call that worked (it may exit 0 and say it failed)."""
    try:
        return proc.returncode == 0 and _json(proc).get("success") is True
    except ValueError:
        return False


@pytest.fixture(scope="module")
def walled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Walled]:
    with netns_pair() as (inside, public, outside, _):
        fed = Walled(tmp_path_factory.mktemp("walled"), wrap=inside, outsider=outside)
        fed.public = public
        bundle = write_bundle(fed.certs, hosts=[public], nodes=3)  # node-2: the extra node
        tls = ["--ssl-certfile", str(bundle.server_cert), "--ssl-keyfile", str(bundle.server_key)]
        tls += ["--ssl-ca-certfile", str(bundle.ca_cert)]
        # The outsider: the CA certificate every machine gets, and a key of its own.
        (fed.root / "stranger").mkdir()
        shutil.copy(bundle.ca_cert, fed.root / "stranger" / "ca.pem")
        write_node_key(fed.root / "stranger" / "key")
        try:
            fed.start_superlink(*tls, "--enable-supernode-auth")
            fed.start_gate(public, *tls)
            for i in range(3):
                done = fed.admin(
                    "supernode", "register", f"{bundle.node_keys[i]}.pub", "--format", "json"
                )
                assert _succeeded(done), done.stdout + done.stderr
                fed.ids[f"node-{i}"] = int(_json(done)["node-id"])
            trust = ["--root-certificates", str(bundle.ca_cert)]
            for i, partition in ((0, 0), (1, 1), (2, 0)):  # the extra node claims partition 0
                key = ["--auth-supernode-private-key", str(bundle.node_keys[i])]
                fed.start_supernode(partition, 2, *trust, *key, name=f"node-{i}")
            stranger = fed.root / "stranger"
            fed.stray = fed.start_supernode(
                1,
                2,
                *["--root-certificates", str(stranger / "ca.pem")],
                *["--auth-supernode-private-key", str(stranger / "key")],
                name="outsider",
                wrap=outside,
            )
            yield fed
        finally:
            fed.stop()


@pytest.mark.integration
def test_an_outsider_can_neither_register_nor_list(walled):
    gate, link = walled.fleet, f"{walled.public}:{walled.port}"
    pub = str(walled.root / "stranger" / "key.pub")
    for address in (gate, link):  # through the gate, and straight at the SuperLink's port
        for args in (("supernode", "register", pub), ("ls",), ("supernode", "ls")):
            tried = walled.stranger(address, *args, "--format", "json")
            assert not _succeeded(tried), (address, args, tried.stdout, tried.stderr)
    # What it sees through the gate: the Fleet API's health check, and 404 for the rest.
    probe = (
        "import httpx, sys\n"
        "c = httpx.Client(base_url=f'https://{sys.argv[1]}', verify=sys.argv[2])\n"
        "print(c.get('/health').status_code, c.post('/v1/control/list-runs').status_code,"
        " c.post('/v1/runtime/acquire-task').status_code)\n"
    )
    ca = str(walled.root / "stranger" / "ca.pem")
    seen = subprocess.run(
        walled.in_b([sys.executable, "-c", probe, gate, ca]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seen.stdout.split() == ["200", "404", "404"], seen.stdout + seen.stderr
    assert "refused POST '/v1/control/list-runs'" in (walled.root / "gate.log").read_text()
    # The operator, on the SuperLink's machine, still has the Control API.
    listed = walled.admin("supernode", "ls", "--format", "json")
    assert _succeeded(listed), listed.stdout + listed.stderr
    assert {int(n["node-id"]) for n in _json(listed)["nodes"]} == set(walled.ids.values())


@pytest.mark.integration
def test_an_outsider_supernode_is_turned_away(walled):
    assert walled.stray is not None and walled.stray.wait(timeout=120) != 0
    log = (walled.root / "outsider.log").read_text()
    assert REFUSED in log and "Failed to activate SuperNode" in log, log[-2000:]
    assert RECEIVING not in log


@pytest.mark.slow  # about 80 s: a two-round TLS run in the namespace, and the local engine's
@pytest.mark.integration
def test_only_allowed_nodes_train_and_the_extra_one_is_refused(walled, tmp_path):
    node1_key = fingerprint(Path(f"{walled.certs / 'node-1'}.pub").read_bytes())
    allow = f"engine.allowed_nodes=[{walled.ids['node-0']},{node1_key}]"  # by id, by key
    tls = ["engine.insecure=false", f"engine.root_certificates={walled.certs / 'ca.pem'}"]
    proc = submit(walled, tmp_path / "dep", *TWO_ROUNDS, *tls, allow)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:] + walled.logs()
    extra = walled.ids["node-2"]
    assert f"refused node {extra} (key SHA256:" in out and "not on engine.allowed_nodes" in out
    rows = read_metrics(tmp_path / "dep")
    assert all(r["replies"] == 2 and r["failed"] == 0 and r["rejected"] == 0 for r in rows)
    local = local_rows(*TWO_ROUNDS)  # the extra node's partition-0 claim changed nothing
    for key in ("accuracy", "loss"):
        assert [r[key] for r in rows] == [r[key] for r in local], key
    for name in ("node-2", "outsider"):
        assert RECEIVING not in (walled.root / f"{name}.log").read_text(), name
    for name in ("node-0", "node-1"):
        assert "Receiving: train message" in (walled.root / f"{name}.log").read_text(), name
