"""TLS certificates and SuperNode keys for a deployment, made with `cryptography`.

`python -m fl.net.tls DIR --host SERVER_HOST --nodes N` writes what flwr 1.42 needs:

- `ca.pem`: the CA every SuperNode (`--root-certificates`), the `flwr` CLI
  (`root-certificates`) and `fl-run` (`engine.root_certificates`) trust;
- `ca.key`: the CA's key, to issue the next server certificate (keep it off the server);
- `server.pem`, `server.key`: the SuperLink's certificate for Fleet, Control and Runtime
  (`--ssl-certfile`, `--ssl-keyfile`, with `--ssl-ca-certfile ca.pem`);
- `node-I`, `node-I.pub`: SuperNode I's key (`--auth-supernode-private-key node-I`); the
  `.pub` is registered on the SuperLink with `flwr supernode register node-I.pub`.

It also prints `engine.allowed_nodes=[SHA256:…,…]`, the node keys' fingerprints (as
`ssh-keygen -lf node-I.pub` prints them): the ServerApp trains only nodes on that list
(server/nodes.py), whichever keys get registered on the SuperLink.

The server certificate names `localhost`, `127.0.0.1` and every `--host` as subject
alternative names (clients check the address they dial against them). Node keys are
ECDSA P-384 in OpenSSH format, the form flwr's node authentication loads. Existing files
are never overwritten, so re-running with a larger `--nodes` only adds keys.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "DEFAULT_HOSTS",
    "FINGERPRINT",
    "Bundle",
    "fingerprint",
    "is_allowlist",
    "make_ca",
    "make_node_key",
    "make_server_cert",
    "write_bundle",
]

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
Signed = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]
FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")  # OpenSSH's form, 32 bytes unpadded
MAX_NODE_ID = 2**64 - 1  # flwr node ids are uint64


@dataclass(frozen=True)
class Bundle:
    """Paths of the files `write_bundle` made (or found)."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]  # private keys; each public key is the same path + ".pub"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def make_ca(common_name: str = "adaptive-fl CA", days: int = 3650) -> Signed:
    """A self-signed certificate authority (EC P-256)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_server_cert(ca: Signed, hosts: Sequence[str], days: int = 825) -> Signed:
    """A server certificate for `hosts` (DNS names or IP addresses), signed by `ca`."""
    if not hosts:
        raise ValueError("a server certificate needs at least one host")
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_node_key() -> ec.EllipticCurvePrivateKey:
    """A SuperNode authentication key: ECDSA on NIST P-384."""
    return ec.generate_private_key(ec.SECP384R1())


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    """Create `path` with `data` (mode 0600 for secrets); never overwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_ca(cert_path: Path, key_path: Path) -> Signed:
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: not an EC private key")
    return key, x509.load_pem_x509_certificate(cert_path.read_bytes())


def write_node_key(path: Path, comment: str = "") -> None:
    """`path` (OpenSSH private key) and `path`.pub (OpenSSH public key) of a new node key."""
    key = make_node_key()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write(path, private, secret=True)
    suffix = f" {comment}".encode() if comment else b""
    _write(path.with_name(path.name + ".pub"), public + suffix + b"\n", secret=False)


def fingerprint(public_key: bytes) -> str:
    """`SHA256:…` of a public key given as PEM (what a SuperLink stores) or an OpenSSH line.

    The same string as `ssh-keygen -lf KEY.pub` prints: SHA-256 of the key's OpenSSH wire
    form, base64 without padding.
    """
    if public_key.lstrip().startswith(b"-----BEGIN"):
        key = serialization.load_pem_public_key(public_key)
    else:
        key = serialization.load_ssh_public_key(public_key.strip().split(b"\n")[0])
    line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    digest = hashlib.sha256(base64.b64decode(line.split()[1])).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def is_allowlist(entries: object) -> bool:
    """A non-empty list of node ids (uint64, as `flwr supernode register` prints them) and
    key fingerprints (`SHA256:…`, see `fingerprint`)."""
    if not isinstance(entries, list | tuple) or not entries:
        return False
    return all(
        (isinstance(e, int) and not isinstance(e, bool) and 0 <= e <= MAX_NODE_ID)
        or (isinstance(e, str) and FINGERPRINT.fullmatch(e) is not None)
        for e in entries
    )


def write_bundle(out: Path, hosts: Sequence[str] = DEFAULT_HOSTS, nodes: int = 0) -> Bundle:
    """CA, server certificate for `hosts` and `nodes` node keys under `out`; keeps existing."""
    out.mkdir(parents=True, exist_ok=True)
    bundle = Bundle(
        out / "ca.pem",
        out / "ca.key",
        out / "server.pem",
        out / "server.key",
        tuple(out / f"node-{i}" for i in range(nodes)),
    )
    if not bundle.ca_cert.exists():
        ca_key, ca_cert = make_ca()
        _write(bundle.ca_key, _pem_key(ca_key), secret=True)
        _write(bundle.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), secret=False)
    if not bundle.server_cert.exists():
        names = list(dict.fromkeys([*hosts, *DEFAULT_HOSTS]))  # ordered, no duplicates
        key, cert = make_server_cert(_load_ca(bundle.ca_cert, bundle.ca_key), names)
        _write(bundle.server_key, _pem_key(key), secret=True)
        _write(bundle.server_cert, cert.public_bytes(serialization.Encoding.PEM), secret=False)
    for i, path in enumerate(bundle.node_keys):
        if not path.exists():
            write_node_key(path, comment=f"fl-node-{i}")
    return bundle


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: `python -m fl.net.tls DIR [--host H ...] [--nodes N]`."""
    parser = argparse.ArgumentParser(
        prog="python -m fl.net.tls", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out", type=Path, help="directory for the certificates and keys")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="name or IP address SuperNodes dial (repeatable; localhost and 127.0.0.1 always)",
    )
    parser.add_argument("--nodes", type=int, default=0, help="node keys node-0 .. node-(N-1)")
    args = parser.parse_args(argv)
    bundle = write_bundle(args.out, args.host, args.nodes)
    for path in (bundle.ca_cert, bundle.server_cert, bundle.server_key, *bundle.node_keys):
        print(path)
    if bundle.node_keys:
        prints = [fingerprint(Path(f"{p}.pub").read_bytes()) for p in bundle.node_keys]
        print(f"engine.allowed_nodes=[{','.join(prints)}]")


if __name__ == "__main__":
    main()
