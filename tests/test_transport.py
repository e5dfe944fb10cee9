"""The bulk side channel (fl.net.transport) and the streamed weighted mean (fl.wire.streaming).

Everything runs for real on 127.0.0.1: the gRPC bulk service, the node's fetch and upload,
the Grid wrapper around a LocalGrid whose nodes run a ClientApp with `bulk_mod`, and, where
NIXL imports, the rdma path. Failures are made by real means: a port nobody listens on, a
byte flipped in a published blob, an upload limit below the reply, a forged reference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import OFFLINE, REPO, fl_env, read_metrics, run_fl
from federation import TWO_ROUNDS, local_rows, running_federation, submit
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from omegaconf import OmegaConf

from fl.common.config import CONF_DIR, compose, to_run_config
from fl.mechanisms.robust import Aggregator, weighted_mean
from fl.net.transport import (
    BulkGrid,
    TransportSettings,
    TransportUnavailable,
    bulk_mod,
    nixl_available,
    transport_grid,
)
from fl.net.transport.digest import PIECE, blob_digest
from fl.net.transport.offer import OFFER, Offer
from fl.net.transport.peer import fetch, upload
from fl.net.transport.reference import REFERENCE, Packer, Reference, ReferenceError, unpack
from fl.net.transport.service import BulkService
from fl.net.transport.store import BlobStore, StoreError
from fl.run.engines.local import LocalGrid
from fl.run.validation import validate
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.records import numpy_to_array
from fl.wire.streaming import BLOCK, COMPILED_MIN, _torch_mean, streamed_weighted_mean
from server.loop import run_training

NEEDS_NIXL = pytest.mark.skipif(nixl_available() is not None, reason="NIXL does not import")


def _arrays(seed: int = 0) -> ArrayRecord:
    rng = np.random.default_rng(seed)
    return ArrayRecord(
        {
            "w": numpy_to_array(rng.standard_normal((64, 33)).astype(np.float32)),
            "b": numpy_to_array(rng.standard_normal(7)),  # float64
            "steps": numpy_to_array(np.array(5, dtype=np.int64)),  # 0-d
            "mask": numpy_to_array(rng.random((3, 4)) > 0.5),
            "empty": numpy_to_array(np.zeros((0, 3), dtype=np.float16)),
        }
    )


def _content(seed: int = 0) -> RecordDict:
    return RecordDict(
        {
            "arrays": _arrays(seed),
            "config": ConfigRecord({"lr": 0.1}),
            "small": ArrayRecord({"x": numpy_to_array(np.ones(2, np.float32))}),
        }
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----- reference records ------------------------------------------------------------------


def test_pack_and_unpack_rebuild_the_same_records_bit_for_bit():
    content = _content()
    rest, reference, blob = Packer(min_bytes=1000).pack(content)
    assert list(rest) == ["config", "small"]  # "small" (8 B) stays inline
    assert reference.nbytes == len(blob) == 64 * 33 * 4 + 7 * 8 + 8 + 12
    wire = Reference.parse(reference.to_record())  # as the receiver reads it
    assert wire == reference
    rest[REFERENCE] = wire.to_record()
    back = unpack(rest, wire, bytes(blob))
    assert list(back) == list(content)  # the original order, not just the same keys
    assert back.object_id == content.object_id  # Flower's content hash: identical bytes


def test_the_blob_digest_is_sha256_over_the_sha256_of_each_piece():
    blob = bytearray(np.random.default_rng(0).bytes(2 * PIECE + 12345))
    pieces = [blob[start : start + PIECE] for start in range(0, len(blob), PIECE)]
    joined = b"".join(hashlib.sha256(piece).digest() for piece in pieces)
    assert blob_digest(blob) == hashlib.sha256(joined).hexdigest()
    assert blob_digest(memoryview(blob)) == blob_digest(bytes(blob))
    assert blob_digest(b"") == hashlib.sha256(b"").hexdigest()  # no pieces
    blob[PIECE] ^= 1
    assert blob_digest(blob) != hashlib.sha256(joined).hexdigest()


def test_the_same_record_sent_to_many_nodes_is_packed_once():
    arrays = _arrays()
    packer = Packer(min_bytes=1)
    first = packer.pack(RecordDict({"arrays": arrays, "config": ConfigRecord({"n": 1})}))
    second = packer.pack(RecordDict({"arrays": arrays, "config": ConfigRecord({"n": 2})}))
    assert first is not None and second is not None
    assert first[2] is second[2]  # one blob
    assert packer.pack(RecordDict({"config": ConfigRecord({"n": 1})})) is None


def _bad(**changes: object) -> ConfigRecord:
    _, reference, _ = Packer(min_bytes=1).pack(_content())
    record = reference.to_record()
    for key, value in changes.items():
        record[key] = value  # type: ignore[assignment]
    return record


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dtypes": ["object"] * 6}, "not allowed"),
        ({"dims": [64, -33, 7, 3, 4, 0, 3, 2]}, "negative"),
        ({"ranks": [2, 1, 0, 2, 2, 2]}, "ranks and dims"),
        ({"nbytes": 12}, "its arrays hold"),
        ({"nbytes": 2**40}, "is not in"),
        ({"sha256": "xyz"}, "sha256"),
        ({"names": ["w", "w", "steps", "mask", "empty", "x"]}, "repeats"),
        ({"names": ["w"] * 70_000}, "more than"),
        ({"records": "arrays"}, "list of str"),
        ({"ranks": [2.0, 1.0, 0.0, 2.0, 2.0, 1.0]}, "list of int"),
        ({"order": ["config"]}, "order"),
    ],
)
def test_malformed_references_are_rejected(changes, message):
    with pytest.raises(ReferenceError, match=message):
        Reference.parse(_bad(**changes))


def test_a_blob_that_does_not_match_its_reference_is_rejected():
    rest, reference, blob = Packer(min_bytes=1).pack(_content())
    blob[5] ^= 1
    with pytest.raises(ReferenceError, match="SHA-256"):
        unpack(rest, reference, blob)
    with pytest.raises(ReferenceError, match="bytes"):
        unpack(rest, reference, blob[:-1])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("kind", "carrier-pigeon"),
        ("peer", "127.0.0.1"),
        ("token", "../../etc"),
        ("ca", "not a certificate"),
        ("chunk-bytes", 0),
        ("timeout-s", -1.0),
    ],
)
def test_malformed_offers_are_rejected(key, value):
    record = Offer("grpc", "127.0.0.1:1", "0" * 32, "", 1, 2**20, 2**20, 5.0).to_record()
    record[key] = value
    with pytest.raises(ReferenceError):
        Offer.parse(record)


# ----- the service and a node's fetch/upload -------------------------------------------------


def _service(tls: bool = False, rdma: bool = False, max_upload: int = 2**20) -> BulkService:
    return BulkService(
        BlobStore(max_upload),
        listen="127.0.0.1:0",
        advertise=None,
        tls=tls,
        chunk_bytes=1000,  # many chunks even for test-sized blobs
        rdma=rdma,
    )


def _offer(service: BulkService, token: str, kind: str = "grpc") -> Offer:
    return Offer(kind, service.address, token, service.ca_pem, 1, 1000, 2**20, 10.0)


@pytest.mark.parametrize("tls", [False, True])
def test_fetch_and_upload_round_trip_through_the_service(tls):
    service = _service(tls=tls)
    try:
        _, reference, blob = Packer(min_bytes=1).pack(_content())
        token = service.store.issue()
        service.store.publish(token, reference.sha256, blob)
        offer = _offer(service, token)
        assert fetch(offer, reference) == blob
        upload(offer, reference, blob)
        assert service.store.take_upload(token, reference.sha256) == blob
        with pytest.raises(grpc.RpcError) as refused:  # one upload per token
            upload(offer, reference, blob)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        stranger = _offer(service, service.store.issue())  # another token: not its blob
        with pytest.raises(grpc.RpcError) as denied:
            fetch(stranger, reference)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        if tls:  # the service's certificate chains only to the CA in the offer
            with pytest.raises(grpc.RpcError):
                fetch(Offer("grpc", service.address, token, "", 1, 1000, 2**20, 5.0), reference)
    finally:
        service.stop()


def test_more_bytes_than_declared_are_cut_off_both_ways():
    service = _service()
    try:
        _, reference, blob = Packer(min_bytes=1).pack(_content())
        token = service.store.issue()
        service.store.publish(token, reference.sha256, blob)
        offer = _offer(service, token)
        shorter = dataclasses.replace(reference, nbytes=100)  # a peer lying about the size
        with pytest.raises(ReferenceError, match="more than the 100 B declared"):
            fetch(offer, shorter)
        stream = grpc.insecure_channel(service.address).stream_unary("/fl.transport.Bulk/Store")
        chunks = iter([b"x" * 600, b"x" * 600])
        meta = (("token", token), ("sha256", "0" * 64), ("nbytes", "1000"))
        with pytest.raises(grpc.RpcError) as cut:
            stream(chunks, metadata=meta, timeout=10)
        assert cut.value.code() == grpc.StatusCode.OUT_OF_RANGE
        with pytest.raises(grpc.RpcError) as wrong:  # declared size, wrong checksum
            stream(iter([b"x" * 1000]), metadata=meta, timeout=10)
        assert wrong.value.code() == grpc.StatusCode.DATA_LOSS
        big = (("token", token), ("sha256", "0" * 64), ("nbytes", str(2**21)))
        with pytest.raises(grpc.RpcError) as over:  # over max_upload_bytes: refused up front
            stream(iter([b"x"]), metadata=big, timeout=10)
        assert over.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        service.stop()


@NEEDS_NIXL
def test_rdma_round_trip_through_nixl():
    service = _service(rdma=True)
    try:
        _, reference, blob = Packer(min_bytes=1).pack(_content())
        token = service.store.issue()
        service.store.publish(token, reference.sha256, blob)
        offer = _offer(service, token, kind="rdma")
        assert fetch(offer, reference) == blob
        upload(offer, reference, blob)
        assert service.store.take_upload(token, reference.sha256) == blob
    finally:
        service.stop()


def test_rdma_without_nixl_fails_with_a_clear_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # absent, as without the [rdma] extra
    nixl_available.cache_clear()
    try:
        with pytest.raises(TransportUnavailable) as refused:
            BulkGrid(LocalGrid(_echo_app(), 1, {}), TransportSettings(name="rdma"))
        assert "transport=rdma needs NIXL (`pip install -e '.[rdma]'`)" in str(refused.value)
    finally:
        nixl_available.cache_clear()


# ----- the Grid wrapper and the mod, with real ClientApp nodes --------------------------------


def _echo_app() -> ClientApp:
    """A ClientApp that returns its arrays doubled (inline or bulk, it cannot tell)."""
    app = ClientApp(mods=[bulk_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        assert OFFER not in msg.content and REFERENCE not in msg.content
        doubled = {k: numpy_to_array(v.numpy() * 2) for k, v in msg.content["arrays"].items()}
        metrics = MetricRecord({"num-examples": 3})
        return Message(
            RecordDict({"arrays": ArrayRecord(doubled), "metrics": metrics}), reply_to=msg
        )

    return app


def _instructions(nodes: list[int]) -> list[Message]:
    return [Message(_content(i), node, "train") for i, node in enumerate(nodes)]


def _round_trip(**settings: object) -> tuple[list[Message], dict[str, int], list[Message]]:
    """Replies of two nodes through a BulkGrid (serialised as on the wire), its counts,
    and the replies of the same instructions sent inline."""
    local = LocalGrid(_echo_app(), 2, {}, serialize=True)
    grid = BulkGrid(local, TransportSettings(name="grpc", min_bytes=1, **settings))  # type: ignore[arg-type]
    try:
        nodes = sorted(local.get_node_ids())
        inline = list(local.send_and_receive(_instructions(nodes)))
        replies = list(grid.send_and_receive(_instructions(nodes), timeout=60))
        return replies, grid.diagnostics(), inline
    finally:
        grid.close()


def _same(replies: list[Message], inline: list[Message]) -> bool:
    """Same contents, bit for bit (Flower's content hash), node by node."""

    def ids(messages: list[Message]) -> list[str]:
        ordered = sorted(messages, key=lambda r: r.metadata.src_node_id)
        return [r.content.object_id for r in ordered]

    return ids(replies) == ids(inline)


def test_replies_through_the_side_channel_equal_inline_replies():
    replies, counts, inline = _round_trip()
    assert _same(replies, inline)
    assert counts == {
        "bulk_down": 2,
        "bulk_up": 2,
        "bulk_fallbacks": 0,
        "bulk_refused": 0,
        "bulk_tls": 0,
    }


def test_a_dead_peer_falls_back_to_inline_and_is_counted():
    replies, counts, inline = _round_trip(advertise=f"127.0.0.1:{_free_port()}", timeout_s=5.0)
    assert _same(replies, inline)  # the instructions were sent again, inline
    assert counts == {
        "bulk_down": 2,
        "bulk_up": 0,
        "bulk_fallbacks": 2,
        "bulk_refused": 0,
        "bulk_tls": 0,
    }


def test_an_upload_over_the_limit_falls_back_to_inline_and_is_counted():
    replies, counts, inline = _round_trip(max_upload_bytes=1000)
    assert _same(replies, inline)
    assert counts == {
        "bulk_down": 2,
        "bulk_up": 0,
        "bulk_fallbacks": 2,
        "bulk_refused": 0,
        "bulk_tls": 0,
    }


def test_a_corrupted_blob_fails_its_checksum_and_is_sent_inline():
    local = LocalGrid(_echo_app(), 1, {}, serialize=True)
    grid = BulkGrid(local, TransportSettings(name="grpc", min_bytes=1))
    try:
        (node,) = grid.get_node_ids()
        (message_id,) = grid.push_messages([Message(_content(), node, "train")])
        token = grid._sent[message_id].token  # the instruction's token, to reach its blob
        offer = Offer.parse(local._pending[message_id].content.config_records[OFFER])
        assert offer.token == token
        reference = Reference.parse(local._pending[message_id].content.config_records[REFERENCE])
        grid.store.blob(token, reference.sha256)[10] ^= 0xFF  # one byte flipped in transit
        assert list(grid.pull_messages([message_id])) == []  # the node asked for it inline
        grid.push_messages([])  # (forgets expired instructions, never one awaiting its retry)
        (reply,) = grid.pull_messages([message_id])  # the answer to the inline instruction
        assert reply.metadata.reply_to_message_id == message_id
        expected = 2 * _arrays()["w"].numpy()
        assert np.array_equal(reply.content["arrays"]["w"].numpy(), expected)
        assert grid.diagnostics()["bulk_fallbacks"] == 1
    finally:
        grid.close()


def test_a_forged_reply_reference_becomes_an_error_reply():
    forger = ClientApp(mods=[bulk_mod])

    @forger.train()
    def train(msg: Message, context: Context) -> Message:  # claims an upload it never made
        _, reference, _ = Packer(min_bytes=1).pack(_content())
        content = RecordDict(
            {"config": ConfigRecord({"lr": 0.1}), REFERENCE: reference.to_record()}
        )
        return Message(content, reply_to=msg)

    grid = BulkGrid(LocalGrid(forger, 1, {}), TransportSettings(name="grpc", min_bytes=1))
    try:
        (node,) = grid.get_node_ids()
        (reply,) = grid.send_and_receive([Message(_content(), node, "train")], timeout=30)
        assert reply.has_error() and "bulk reference refused" in reply.error.reason
        assert grid.diagnostics()["bulk_refused"] == 1
    finally:
        grid.close()


# ----- the whole round loop -----------------------------------------------------------------


def _train(out: Path, *overrides: str) -> list[dict]:
    import clients.app as client

    cfg = compose(["num_clients=2", "clients_per_round=2", "rounds=1", *overrides])
    validate(cfg)
    local = LocalGrid(client.app, cfg.num_clients, to_run_config(cfg), serialize=True)
    with transport_grid(local, cfg) as grid:
        run_training(grid, cfg, out)
    return read_metrics(out)


BULK_KEYS = ("bulk_down", "bulk_up", "bulk_fallbacks", "bulk_refused", "bulk_tls")


def _strip(rows: list[dict]) -> list[dict]:
    """Rows without the side channel's counts and the wall clock."""
    return [{k: v for k, v in r.items() if k not in (*BULK_KEYS, "wall_time_s")} for r in rows]


def test_a_run_over_the_side_channel_trains_the_same_model(tmp_path):
    inline = _train(tmp_path / "inline")
    bulk = _train(tmp_path / "grpc", "transport=grpc", "transport.min_bytes=1")
    assert [(r["bulk_down"], r["bulk_up"], r["bulk_fallbacks"]) for r in bulk] == [(2, 2, 0)]
    assert _strip(bulk) == _strip(inline)
    first = torch.load(tmp_path / "inline" / "model.pt")
    second = torch.load(tmp_path / "grpc" / "model.pt")
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.slow  # about 60 s: a real SuperLink, two SuperNodes, two runs
@pytest.mark.integration
def test_a_deployment_over_grpc_matches_the_local_engine(tmp_path):
    with running_federation(tmp_path / "federation") as fed:
        proc = submit(fed, tmp_path / "dep", *TWO_ROUNDS, "transport=grpc", "transport.min_bytes=1")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + fed.logs()
    rows = read_metrics(tmp_path / "dep")
    assert [r["bulk_up"] for r in rows] == [2, 2] and [r["bulk_down"] for r in rows] == [2, 2]
    assert all(r["bulk_fallbacks"] == 0 and r["replies"] == 2 for r in rows)
    for key in ("accuracy", "loss", "bytes_up", "bytes_down"):
        assert [r[key] for r in rows] == [r[key] for r in local_rows(*TWO_ROUNDS)], key


# ----- the streamed weighted mean -----------------------------------------------------------


@pytest.mark.parametrize(("clients", "size"), [(1, 5), (3, BLOCK), (10, 3 * BLOCK + 17)])
def test_the_streamed_mean_equals_the_stacked_reference(clients, size):
    gen = torch.Generator().manual_seed(clients)
    vectors = [torch.randn(size, generator=gen) * 10 for _ in range(clients)]
    weights = torch.randint(1, 1000, (clients,), generator=gen).double()
    streamed = streamed_weighted_mean(vectors, weights)
    stacked = weighted_mean(torch.stack(vectors), weights)
    assert streamed.dtype == torch.float32
    # Both round a float64 sum to float32: at most one float32 ulp apart. (Equal where the
    # BLAS behind the reference fuses a * x + acc as we do; MKL on AMD CPUs does not.)
    assert _within_one_ulp(streamed, stacked)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x.abs(), torch.tensor(float("inf"))) - x.abs()


def _within_one_ulp(x: torch.Tensor, reference: torch.Tensor) -> bool:
    return bool(((x - reference).abs() <= _ulp(reference)).all())


def test_the_compiled_kernel_gives_the_torch_path_s_bits():
    # Large vectors take the Numba kernel, small ones torch: the same sums to the last bit.
    gen = torch.Generator().manual_seed(7)
    size = COMPILED_MIN + BLOCK // 2 + 3
    vectors = [torch.randn(size, generator=gen) * 10 for _ in range(4)]
    weights = torch.randint(1, 1000, (4,), generator=gen).double()
    compiled = streamed_weighted_mean(vectors, weights)
    scale = (weights / weights.sum()).tolist()
    assert torch.equal(compiled, _torch_mean(vectors, scale))
    assert _within_one_ulp(compiled, weighted_mean(torch.stack(vectors), weights))
    # A strided (non-contiguous) slice takes the torch path, with the same result.
    strided = [torch.randn(2 * size, generator=gen)[::2] for _ in range(2)]
    halves = torch.tensor([1.0, 3.0], dtype=torch.float64)
    assert torch.equal(streamed_weighted_mean(strided, halves), _torch_mean(strided, [0.25, 0.75]))


def test_the_strategy_streams_the_mean_and_stacks_for_robust_rules():
    gen = torch.Generator().manual_seed(0)
    updates = [ClientUpdate(i, torch.randn(100, generator=gen), 10 + i, {}) for i in range(5)]
    stack = torch.stack([u.vector for u in updates])
    weights = torch.tensor([u.num_examples for u in updates], dtype=torch.float64)
    for name in ("mean", "median", "trimmed_mean"):
        rule = Aggregator(name=name)
        strategy = ServerStrategy(None, seed=0, clients_per_round=5, aggregator=rule)
        assert torch.equal(strategy.aggregate(1, updates), rule(stack, weights)), name
    with pytest.raises(ValueError, match="equal length"):
        streamed_weighted_mean([torch.zeros(3), torch.zeros(4)], torch.ones(2))


@pytest.mark.slow  # about 60 s: a SuperLink, a SuperNode and blocks of messages per mode
@pytest.mark.integration
def test_bench_transport_writes_the_promised_keys(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "experiments/bench_transport.py", "--json", str(out), "--mb", "4"]
    proc = subprocess.run(
        [*cmd, "--repeats", "2"],
        cwd=REPO,
        env={**fl_env(), **OFFLINE},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    keys = ("inline_s", "grpc_s", "grpc_process_s", "aggregate_gbps", "flower_aggregate_gbps")
    for key in (*keys, "memcpy_gbps"):
        assert isinstance(result[key], float), key
    assert result["inline_s"] > 0 and result["grpc_s"] > 0 and result["aggregate_gbps"] > 0
    for key in ("rdma_s", "rdma_process_s"):
        assert (result[key] is None) == (nixl_available() is not None)
    modes = ("inline", "grpc", "grpc_process")
    assert [len(result["rows"][mode]) for mode in modes] == [2, 2, 2]
    assert len(result["load_avg"]) == 2
    assert set(result["bulk_fallbacks"].values()) == {0}  # all aside, through the node's agent
    assert result["inline_node_bulk_s"] < result["grpc_node_bulk_s"]  # inline: no transfer


def test_the_side_channel_uses_tls_whenever_the_deployment_does():
    def settings(*overrides: str) -> TransportSettings:
        return TransportSettings.from_config(compose(["transport=grpc", *overrides]))

    assert not settings("engine=deployment").tls  # engine.insecure=true
    assert settings("engine=deployment", "engine.insecure=false").tls
    assert TransportSettings.from_config(compose([])).name == "inline"  # the default
    with pytest.raises(ValueError, match=r"transport\.tls"):
        settings("transport.tls=sometimes")


@pytest.mark.parametrize("name", ["grpc", "rdma"])
def test_the_config_files_hold_the_settings_defaults(name):
    values = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "transport" / f"{name}.yaml"))
    assert values.pop("name") == name and values.pop("tls") == "auto"
    defaults = dataclasses.asdict(TransportSettings())
    assert values == {k: v for k, v in defaults.items() if k in values}
    assert set(values) == set(defaults) - {"name", "tls"}


def _trickle(first: bytes, hold: threading.Event) -> Iterator[bytes]:
    """An upload stream that sends `first`, then waits (a slow or stalled peer)."""
    yield first
    hold.wait(30)


def test_an_upload_stream_is_one_per_token_and_cut_off_at_its_deadline():
    service = BulkService(
        BlobStore(2**20),
        listen="127.0.0.1:0",
        advertise=None,
        tls=False,
        chunk_bytes=1000,
        workers=4,
        upload_timeout_s=1.0,
    )
    hold = threading.Event()
    try:
        _, reference, blob = Packer(min_bytes=1).pack(_content())
        token = service.store.issue()
        service.store.publish(token, reference.sha256, blob)
        store = grpc.insecure_channel(service.address).stream_unary("/fl.transport.Bulk/Store")
        meta = (("token", token), ("sha256", "0" * 64), ("nbytes", "1000"))
        slow = store.future(_trickle(b"x", hold), metadata=meta, timeout=30)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as second:  # the same token, a second stream
            store(iter([b"x" * 1000]), metadata=meta, timeout=10)
        assert second.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "already under way" in second.value.details()
        fetched = fetch(_offer(service, token), reference)  # fetches are still served
        assert bytes(fetched) == bytes(blob)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError):
            slow.result(timeout=10)  # cut off by the service at its deadline
        assert time.monotonic() - started < 5
        # the handler frees the token once its thread sees the cancel: shortly after, not
        # necessarily before the client does
        while True:
            try:
                service.store.begin_upload(token, 10)  # the token's stream is free again
                break
            except StoreError:
                assert time.monotonic() - started < 5, "the cut-off stream kept its token"
                time.sleep(0.02)
    finally:
        hold.set()
        service.stop()


def test_uploads_are_capped_by_the_runs_reply_bound():
    cfg = compose(["transport=grpc"])
    local = LocalGrid(_echo_app(), 1, {})
    with transport_grid(local, cfg, max_reply_bytes=5000) as bulk:
        assert isinstance(bulk, BulkGrid) and bulk.store.max_upload_bytes == 5000
        token = bulk.store.issue()
        with pytest.raises(StoreError, match="exceeds the limit of 5000 B"):
            bulk.store.begin_upload(token, 5001)


def test_a_client_that_never_replies_does_not_stall_the_side_channel(tmp_path):
    """Local engine, transport=grpc, faults=mixed: dropped and hung nodes never reply; the
    run goes on at once, with the rounds the inline run has (the round loop's deadline, up
    to an hour of real time, was waited for every missing reply)."""
    small = ["num_clients=6", "clients_per_round=6", "rounds=3", "faults=mixed", "progress=false"]
    run_fl(tmp_path / "inline", *small, timeout=120)
    run_fl(tmp_path / "grpc", *small, "transport=grpc", timeout=120)
    inline, bulk = read_metrics(tmp_path / "inline"), read_metrics(tmp_path / "grpc")
    assert [r["round"] for r in bulk] == [1, 2, 3]
    keys = ("accuracy", "loss", "missing", "failed", "virtual_time_s")
    assert [[r[k] for k in keys] for r in bulk] == [[r[k] for k in keys] for r in inline]
    assert sum(r["missing"] for r in bulk) > 0  # the fault mix did leave nodes silent
