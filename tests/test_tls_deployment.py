"""A TLS SuperLink with SuperNode authentication: registered nodes train, intruders are refused.

Certificates and node keys come from `fl.net.tls` (the repo's generator). On 127.0.0.1: a
SuperLink with `--ssl-*` and `--enable-supernode-auth`, two SuperNodes whose public keys
were registered with `flwr supernode register`, and three that must be turned away: an
unregistered key, no key at all, and a registered key without the CA certificate.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import read_metrics
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from federation import TWO_ROUNDS, Federation, local_rows, submit
from flwr.cli.supernode.register import try_load_public_key

from fl.net.tls import FINGERPRINT, fingerprint, is_allowlist, main, write_bundle

REFUSED = "Exit Code: 305"  # flwr's SUPERNODE_CONNECTION_ERROR, logged before the node exits
INTRUDERS = {
    # name: (extra flags, what the SuperNode's log must say)
    "unregistered": (["--auth-supernode-private-key", "node-2"], "Failed to activate SuperNode"),
    "no-key": ([], "All SuperNodes must be registered via the CLI"),
    "no-ca": (["--auth-supernode-private-key", "node-0"], "CERTIFICATE_VERIFY_FAILED"),
}


# ----- the generator, without Flower ---------------------------------------------------------


def test_certificates_verify_for_loopback_and_extra_hosts(tmp_path):
    bundle = write_bundle(tmp_path, hosts=["fl.example.org", "10.1.2.3"], nodes=2)
    cert = x509.load_pem_x509_certificate(bundle.server_cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"fl.example.org", "localhost"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"10.1.2.3", "127.0.0.1"}
    assert bundle.ca_key.stat().st_mode & 0o777 == 0o600
    assert bundle.server_key.stat().st_mode & 0o777 == 0o600

    # A real TLS handshake on loopback: 127.0.0.1 verifies, a name not in the SAN does not.
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(bundle.server_cert, bundle.server_key)
    client_ctx = ssl.create_default_context(cafile=str(bundle.ca_cert))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            for _ in range(2):
                conn, _ = listener.accept()
                try:
                    with server_ctx.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(b"ok")
                except ssl.SSLError:
                    pass  # the client refused us, as it should for the wrong name

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with (
            socket.create_connection(("127.0.0.1", port)) as raw,
            client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            assert tls.recv(2) == b"ok"
        with (
            pytest.raises(ssl.SSLCertVerificationError, match="mismatch"),
            socket.create_connection(("127.0.0.1", port)) as raw,
        ):
            client_ctx.wrap_socket(raw, server_hostname="elsewhere.example.org")
        thread.join(timeout=10)


def test_node_keys_are_what_flwr_node_auth_loads(tmp_path):
    bundle = write_bundle(tmp_path, nodes=2)
    for path in bundle.node_keys:
        key = load_ssh_private_key(path.read_bytes(), None)  # as flower-supernode does
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        public = Path(f"{path}.pub")
        assert public.read_text().startswith("ecdsa-sha2-nistp384 ")
        assert try_load_public_key(public)  # as `flwr supernode register` does
    first = bundle.node_keys[0].read_bytes()
    again = write_bundle(tmp_path, nodes=3)  # re-running adds keys, keeps existing ones
    assert again.node_keys[0].read_bytes() == first and again.node_keys[2].exists()


def test_the_command_line_writes_the_bundle(tmp_path, capsys):
    main([str(tmp_path / "certs"), "--host", "10.0.0.5", "--nodes", "2"])
    *paths, allow = capsys.readouterr().out.split()
    assert paths == [
        str(tmp_path / "certs" / name)
        for name in ("ca.pem", "server.pem", "server.key", "node-0", "node-1")
    ]
    prints = [fingerprint((tmp_path / "certs" / f"node-{i}.pub").read_bytes()) for i in (0, 1)]
    assert allow == f"engine.allowed_nodes=[{','.join(prints)}]"


def test_fingerprints_are_those_ssh_keygen_prints(tmp_path):
    bundle = write_bundle(tmp_path, nodes=1)
    public = Path(f"{bundle.node_keys[0]}.pub")
    mine = fingerprint(public.read_bytes())
    assert FINGERPRINT.fullmatch(mine) and is_allowlist([mine, 6703112])
    # The SuperLink stores the key as PEM (what the ServerApp sees in NodeInfo.public_key).
    assert fingerprint(try_load_public_key(public)) == mine
    if shutil.which("ssh-keygen"):
        shown = subprocess.run(
            ["ssh-keygen", "-lf", str(public)], capture_output=True, text=True, check=True
        )
        assert shown.stdout.split()[1] == mine
    for bad in ([], [True], [-1], [2**64], ["SHA256:short"], "SHA256:x", None):
        assert not is_allowlist(bad), bad


# ----- a real secure federation ---------------------------------------------------------------


@dataclass
class SecureFederation(Federation):
    """A TLS + node-auth SuperLink, its registered SuperNodes, and refused intruders."""

    intruders: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    registered: list[int] = field(default_factory=list)

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    def admin(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The `flwr` CLI against this SuperLink's Control API, trusting its CA."""
        return self.flwr(*args, ca=self.certs / "ca.pem")


def _json(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout[proc.stdout.index("{") :])


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureFederation]:
    fed = SecureFederation(tmp_path_factory.mktemp("secure"))
    bundle = write_bundle(fed.certs, nodes=3)  # node-2 is never registered
    trust = ["--root-certificates", str(bundle.ca_cert)]
    try:
        fed.start_superlink(
            *["--ssl-certfile", str(bundle.server_cert), "--ssl-keyfile", str(bundle.server_key)],
            *["--ssl-ca-certfile", str(bundle.ca_cert), "--enable-supernode-auth"],
        )
        for i in (0, 1):
            done = fed.admin(
                "supernode", "register", f"{bundle.node_keys[i]}.pub", "--format", "json"
            )
            assert done.returncode == 0, done.stdout + done.stderr
            fed.registered.append(int(_json(done)["node-id"]))
        for i in (0, 1):
            fed.start_supernode(
                i, 2, *trust, "--auth-supernode-private-key", str(bundle.node_keys[i])
            )
        for name, (flags, _) in INTRUDERS.items():
            resolved = [str(fed.certs / f) if f.startswith("node-") else f for f in flags]
            trusting = [] if name == "no-ca" else trust
            fed.intruders[name] = fed.start_supernode(0, 2, *trusting, *resolved, name=name)
        yield fed
    finally:
        fed.stop()


@pytest.mark.slow  # about 60 s: a full TLS deployment run
@pytest.mark.integration
def test_registered_tls_nodes_complete_rounds_like_the_local_engine(secure, tmp_path):
    tls = ["engine.insecure=false", f"engine.root_certificates={secure.certs / 'ca.pem'}"]
    proc = submit(secure, tmp_path / "dep", *TWO_ROUNDS, *tls)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + secure.logs()
    rows = read_metrics(tmp_path / "dep")
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["replies"] == 2 and r["failed"] == 0 and r["rejected"] == 0 for r in rows)
    local = local_rows(*TWO_ROUNDS)
    for key in ("accuracy", "loss", "bytes_up", "bytes_down"):
        assert [r[key] for r in rows] == [r[key] for r in local], key


@pytest.mark.slow  # about 60 s: a full TLS deployment run with the side channel
@pytest.mark.integration
def test_the_grpc_side_channel_runs_over_tls_in_a_tls_deployment(secure, tmp_path):
    tls = ["engine.insecure=false", f"engine.root_certificates={secure.certs / 'ca.pem'}"]
    bulk = ["transport=grpc", "transport.min_bytes=1"]
    proc = submit(secure, tmp_path / "dep", *TWO_ROUNDS, *tls, *bulk)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + secure.logs()
    rows = read_metrics(tmp_path / "dep")
    assert [(r["bulk_down"], r["bulk_up"], r["bulk_fallbacks"]) for r in rows] == [(2, 2, 0)] * 2
    # the service serves TLS only, so every transfer counted above went over TLS
    assert all(r["bulk_tls"] == 1 for r in rows)
    local = local_rows(*TWO_ROUNDS)
    for key in ("accuracy", "loss", "bytes_up", "bytes_down"):
        assert [r[key] for r in rows] == [r[key] for r in local], key


@pytest.mark.integration
@pytest.mark.parametrize("name", list(INTRUDERS))
def test_unauthenticated_or_untrusting_nodes_are_refused(secure, name):
    intruder = secure.intruders[name]
    assert intruder.wait(timeout=120) != 0
    log = (secure.root / f"{name}.log").read_text()
    assert REFUSED in log and INTRUDERS[name][1] in log, log[-2000:]
    listed = secure.admin("supernode", "ls", "--format", "json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    nodes = {int(n["node-id"]): n["status"] for n in _json(listed)["nodes"]}
    assert set(nodes) == set(secure.registered)  # nobody else ever got a node id


@pytest.mark.integration
def test_the_control_api_needs_the_ca_too(secure):
    trusted = secure.admin("supernode", "ls", "--format", "json")
    assert _json(trusted)["success"] is True
    refused = _json(secure.flwr("supernode", "ls", "--format", "json", ca=None, name="cli-no-ca"))
    assert refused["success"] is False  # (flwr exits 0 here; the JSON says it failed)
    assert "Connection to the SuperLink is unavailable" in refused["error-message"]
