"""The node's bulk agent (fl.net.transport.sidecar): shared memory, its protocol, its limits.

The sidecar runs for real (in a thread of this process, or as its own process for the
exit tests) on a Unix socket, against a real gRPC bulk service on 127.0.0.1, and behind
`bulk_mod` in real ClientApp nodes. Its mechanics are tested over `transport=grpc`, so
they run without NIXL; the rdma test skips where NIXL does not import.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import python_popen
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from fl.net.transport import BulkGrid, TransportSettings, bulk_mod, nixl_available
from fl.net.transport.control import MAX_PACKET, ControlError, receive, send
from fl.net.transport.links import NODE_CONFIG_KEY, SidecarLink
from fl.net.transport.offer import Offer
from fl.net.transport.reference import Packer
from fl.net.transport.segments import GRAIN, SegmentError, SegmentPool
from fl.net.transport.service import BulkService
from fl.net.transport.sidecar import Sidecar
from fl.net.transport.store import BlobStore
from fl.run.engines.local import LocalGrid
from fl.wire.records import numpy_to_array

NEEDS_NIXL = pytest.mark.skipif(nixl_available() is not None, reason="NIXL does not import")


def _content(seed: int = 0, size: int = 5000) -> RecordDict:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(size).astype(np.float32)
    return RecordDict({"arrays": ArrayRecord({"w": numpy_to_array(w)}), "cfg": ConfigRecord({})})


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket's path is at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="fl-sc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class _Running:
    """A sidecar serving from a thread of this process."""

    def __init__(self, path: Path, nixl: bool = False, **options: object) -> None:
        self.sidecar = Sidecar(path, nixl=nixl, **options)  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.sidecar.serve_forever, daemon=True)
        self.thread.start()
        self.path = str(path)

    def close(self) -> None:
        self.sidecar.stop()
        self.thread.join(10)
        self.sidecar.close()


@pytest.fixture
def agent(short_dir: Path) -> Iterator[_Running]:
    running = _Running(short_dir / "agent.sock", lease_s=10.0, max_bytes=2**24)
    yield running
    running.close()


@pytest.fixture
def service() -> Iterator[BulkService]:
    bulk = BulkService(
        BlobStore(2**20), listen="127.0.0.1:0", advertise=None, tls=False, chunk_bytes=1000
    )
    yield bulk
    bulk.stop()


def _published(service: BulkService, seed: int = 0, kind: str = "grpc") -> tuple:
    """An offer, a reference and the blob it names, published in the service."""
    _, reference, blob = Packer(min_bytes=1).pack(_content(seed))
    token = service.store.issue()
    service.store.publish(token, reference.sha256, blob)
    offer = Offer(kind, service.address, token, service.ca_pem, 1, 1000, 2**20, 10.0)
    return offer, reference, blob


def _leased(running: _Running) -> int:
    return len(running.sidecar.down._leased) + len(running.sidecar.up._leased)


def _settled(running: _Running) -> bool:
    """Whether every lease has come back (the agent's thread sees the hang-up shortly)."""
    deadline = time.monotonic() + 5
    while _leased(running) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _leased(running) == 0


# ----- fetch and upload through shared memory ---------------------------------------------


def test_fetch_and_upload_go_through_the_agent_s_shared_memory(agent, service):
    link = SidecarLink(agent.path)
    assert link.ping()["ok"] is True
    for seed in range(2):  # the second time in the same (reused) segments
        offer, reference, blob = _published(service, seed)
        with link.fetch(offer, reference) as fetched:
            assert isinstance(fetched, memoryview) and fetched == blob
        with link.upload(offer) as outgoing:
            _, up_reference, up_blob = Packer(min_bytes=1).pack(_content(seed), outgoing.allocate)
            assert isinstance(up_blob, memoryview)  # packed straight into shared memory
            outgoing.send(up_reference, up_blob)
            del up_blob
        assert service.store.take_upload(offer.token, reference.sha256) == blob
    assert _settled(agent)
    down, up = agent.sidecar.down._free, agent.sidecar.up._free
    assert [s.uses for s in down] == [2] and [s.uses for s in up] == [2]


def test_the_agent_dials_a_tls_service_with_the_offer_s_ca(agent):
    tls = BulkService(
        BlobStore(2**20), listen="127.0.0.1:0", advertise=None, tls=True, chunk_bytes=1000
    )
    try:
        offer, reference, blob = _published(tls)
        assert offer.ca_pem.startswith("-----BEGIN CERTIFICATE-----")
        with SidecarLink(agent.path).fetch(offer, reference) as fetched:
            assert fetched == blob
        stranger = dataclasses.replace(offer, ca_pem="")  # no CA: no TLS, no bytes
        with pytest.raises(ControlError), SidecarLink(agent.path).fetch(stranger, reference):
            pass
    finally:
        tls.stop()
    assert _settled(agent)


def test_a_fetched_segment_is_read_only_and_an_upload_segment_cannot_shrink(agent, service):
    offer, reference, _ = _published(service)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(agent.path)
        request = {"op": "fetch", "offer": dict(offer.to_record()), "sha256": reference.sha256}
        send(sock, {**request, "nbytes": reference.nbytes})
        answer, fd = receive(sock, with_fd=True)
        assert answer == {"ok": True, "nbytes": reference.nbytes} and fd is not None
        with pytest.raises(PermissionError):  # opened read-only: no writable mapping
            mmap.mmap(fd, reference.nbytes, access=mmap.ACCESS_WRITE)
        os.close(fd)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(agent.path)
        send(sock, {"op": "lease", "nbytes": 100})
        answer, fd = receive(sock, with_fd=True)
        assert answer["ok"] is True and fd is not None
        with pytest.raises(PermissionError):  # sealed: the agent's mapping stays valid
            os.ftruncate(fd, 10)
        os.close(fd)
    assert _settled(agent)


# ----- untrusted requests --------------------------------------------------------------------


def _raw(path: str, *packets: bytes) -> dict:
    """Send raw packets; the agent's last answer before it hung up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(path)
        for packet in packets:
            sock.sendall(packet)
        answers = [receive(sock)[0]]
        while answers[-1]:
            answers.append(receive(sock)[0])
        return answers[-2]


def _json(body: object) -> bytes:
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("packets", "message"),
    [
        ([b"not json"], "not JSON"),
        ([b"[1, 2]"], "not a JSON object"),
        ([b"{" + b" " * MAX_PACKET + b"}"], "over"),
        ([_json({"op": "format-disk"})], "unknown op"),
        ([_json({"op": "lease", "nbytes": -1})], "nbytes"),
        ([_json({"op": "lease", "nbytes": True})], "nbytes"),
        ([_json({"op": "lease", "nbytes": 2**70})], "nbytes"),
        ([_json({"op": "lease", "nbytes": 2**25})], "limit"),  # over the agent's max_bytes
        ([_json({"op": "fetch", "sha256": "0" * 64, "nbytes": 8})], "no offer"),
        ([_json({"op": "lease", "nbytes": 8}), _json({"op": "fetch"})], "followed by"),
    ],
)
def test_malformed_requests_are_answered_with_an_error_and_hold_nothing(agent, packets, message):
    answer = _raw(agent.path, *packets)
    assert answer["ok"] is False and message in answer["error"]
    assert _settled(agent)
    assert SidecarLink(agent.path).ping()["ok"] is True  # still serving


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("peer", "../../etc/passwd", "peer"),
        ("kind", "carrier-pigeon", "kind"),
        ("token", "x" * 32, "token"),
        ("sha256", "ab", "sha256"),
        ("nbytes", 2**25, "limit"),  # over the agent's max_bytes
        ("rdma", None, "no NIXL"),  # this agent was started without NIXL
    ],
)
def test_bad_offers_and_ids_are_refused_before_anything_is_fetched(
    agent, service, key, value, message
):
    offer, reference, _ = _published(service)
    body = {
        "op": "fetch",
        "offer": dict(offer.to_record()),
        "sha256": reference.sha256,
        "nbytes": reference.nbytes,
    }
    if key in ("peer", "kind", "token"):
        body["offer"][key] = value
    elif key == "rdma":
        body["offer"]["kind"] = "rdma"
    else:
        body[key] = value
    answer = _raw(agent.path, _json(body))
    assert answer["ok"] is False and message in answer["error"]
    assert _settled(agent)


def test_a_blob_that_fails_its_checksum_is_not_handed_over(agent, service):
    offer, reference, _ = _published(service)
    service.store.blob(offer.token, reference.sha256)[3] ^= 1  # corrupted at the source
    with (
        pytest.raises(ControlError, match="SHA-256"),
        SidecarLink(agent.path).fetch(offer, reference),
    ):
        pass
    assert _settled(agent)


def test_a_client_that_hangs_up_mid_lease_gives_the_segment_back(agent):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(agent.path)
        send(sock, {"op": "lease", "nbytes": 3 * GRAIN + 1})
        answer, fd = receive(sock, with_fd=True)
        assert answer["ok"] is True and fd is not None
        os.close(fd)
    assert _settled(agent)
    assert [s.capacity for s in agent.sidecar.up._free] == [4 * GRAIN]


def test_the_pool_reuses_segments_and_keeps_its_limit():
    closed = []
    pool = SegmentPool(4 * GRAIN, on_close=closed.append)
    try:
        first = pool.lease(GRAIN)
        pool.give_back(first)
        assert pool.lease(GRAIN // 2) is first  # reused
        with pytest.raises(SegmentError, match="do not fit"):
            pool.lease(4 * GRAIN)  # one segment is still leased
        pool.give_back(first)
        big = pool.lease(4 * GRAIN)  # the free segment is closed to make room
        assert closed == [first] and pool.held_bytes == 4 * GRAIN
        pool.give_back(big)
    finally:
        pool.close()
    assert closed == [first, big]


# ----- behind bulk_mod, and its fallbacks ----------------------------------------------------


def _echo_app(agent_path: str | None) -> ClientApp:
    """A ClientApp that returns its arrays doubled, with the node config naming a bulk
    agent (as `flower-supernode --node-config "bulk-agent=PATH"` does)."""

    def node_config(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if agent_path is not None:
            context.node_config[NODE_CONFIG_KEY] = agent_path
        return call_next(msg, context)

    app = ClientApp(mods=[node_config, bulk_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        doubled = {k: numpy_to_array(v.numpy() * 2) for k, v in msg.content["arrays"].items()}
        metrics = MetricRecord({"num-examples": 3})
        return Message(
            RecordDict({"arrays": ArrayRecord(doubled), "metrics": metrics}), reply_to=msg
        )

    return app


def _round_trip(agent_path: str | None) -> tuple[list[Message], dict[str, int], list[Message]]:
    local = LocalGrid(_echo_app(agent_path), 2, {}, serialize=True)
    grid = BulkGrid(local, TransportSettings(name="grpc", min_bytes=1, timeout_s=10.0))
    try:
        nodes = sorted(local.get_node_ids())
        inline = list(local.send_and_receive([Message(_content(n), n, "train") for n in nodes]))
        messages = [Message(_content(n), n, "train") for n in nodes]
        replies = list(grid.send_and_receive(messages, timeout=60))
        return replies, grid.diagnostics(), inline
    finally:
        grid.close()


def _ids(messages: list[Message]) -> list[str]:
    return [m.content.object_id for m in sorted(messages, key=lambda m: m.metadata.src_node_id)]


def test_bulk_mod_moves_the_bytes_through_the_node_s_agent(agent):
    replies, counts, inline = _round_trip(agent.path)
    assert _ids(replies) == _ids(inline)
    assert (counts["bulk_down"], counts["bulk_up"], counts["bulk_fallbacks"]) == (2, 2, 0)
    assert _settled(agent)
    assert sum(s.uses for s in agent.sidecar.down._free) == 2  # it did the transfers
    assert sum(s.uses for s in agent.sidecar.up._free) == 2


def test_a_dead_agent_falls_back_to_inline_and_is_counted(short_dir):
    replies, counts, inline = _round_trip(str(short_dir / "nobody.sock"))
    assert _ids(replies) == _ids(inline)  # sent again inline: the round goes on
    assert (counts["bulk_down"], counts["bulk_up"], counts["bulk_fallbacks"]) == (2, 0, 2)


def test_an_agent_over_its_memory_limit_falls_back_to_inline(short_dir):
    small = _Running(short_dir / "small.sock", max_bytes=1000)  # the blobs hold 20,000 B
    try:
        replies, counts, inline = _round_trip(small.path)
    finally:
        small.close()
    assert _ids(replies) == _ids(inline)
    assert (counts["bulk_down"], counts["bulk_up"], counts["bulk_fallbacks"]) == (2, 0, 2)


# ----- the process: start, exit, stale sockets ----------------------------------------------


def test_the_agent_process_cleans_up_on_exit_and_replaces_a_stale_socket(short_dir):
    path = short_dir / "agent.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(path))  # a socket file nobody listens on (a killed agent's)
    stale.close()
    cmd = ["-m", "fl.net.transport.sidecar", "--socket", str(path), "--no-nixl"]
    proc = python_popen([sys.executable, *cmd])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert SidecarLink(str(path)).ping()["nixl"] is False
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        with pytest.raises(FileExistsError, match="already listens"):
            Sidecar(path, nixl=False)  # a second agent on a live socket
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not path.exists()


@NEEDS_NIXL
def test_rdma_through_the_agent_registers_each_segment_once(short_dir):
    running = _Running(short_dir / "agent.sock", nixl=True)
    bulk = BulkService(
        BlobStore(2**20), listen="127.0.0.1:0", advertise=None, tls=False, chunk_bytes=1000,
        rdma=True,
    )  # fmt: skip
    try:
        link = SidecarLink(running.path)
        for seed in range(2):
            offer, reference, blob = _published(bulk, seed, kind="rdma")
            with link.fetch(offer, reference) as fetched:
                assert fetched == blob
            with link.upload(offer) as outgoing:
                _, up_ref, up_blob = Packer(min_bytes=1).pack(_content(seed), outgoing.allocate)
                outgoing.send(up_ref, up_blob)
                del up_blob
            assert bulk.store.take_upload(offer.token, reference.sha256) == blob
        assert _settled(running)
        (down,), (up,) = running.sidecar.down._free, running.sidecar.up._free
        assert down.registered and up.registered and down.uses == up.uses == 2
    finally:
        bulk.stop()
        running.close()
