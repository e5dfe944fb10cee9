"""The shared sync protocol: exact copies, the cheapest form, resync after a gap or a failure."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fl.wire.codec import CodecError, payload_traffic
from fl.wire.packing import pack, packed_bytes, unpack
from fl.wire.records import Layout, numpy_to_array
from fl.wire.sync import SyncClient, Synced, SyncServer

N = 1000
LAYOUT = Layout(("w",), ((N,),), (torch.float32,))


def halve(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    values[index] = torch.clamp(values[index] // 2, min=1)
    return values


SPECS = (
    Synced("model", payload=True, within="mask"),
    Synced("mask", dtype=torch.bool, initial=lambda n: torch.ones(n, dtype=torch.bool)),
    Synced(
        "periods",
        dtype=torch.int16,
        initial=lambda n: torch.full((n,), 64, dtype=torch.int64),
        advance=halve,
    ),
)


class World:
    """A server evolving its tensors the way APF and PAS do, and client states."""

    def __init__(self, specs: tuple[Synced, ...] = SPECS) -> None:
        self.server = SyncServer(specs)
        self.client = SyncClient(specs)
        self.states: dict[int, RecordDict] = {}
        self.generator = torch.Generator().manual_seed(0)
        self.model = torch.randn(N, generator=self.generator)
        self.mask = torch.ones(N, dtype=torch.bool)
        self.periods = torch.full((N,), 64, dtype=torch.int64)
        self.version = 0

    def step(self) -> None:
        """A round: active scalars move, the mask changes a little, a few periods halve."""
        self.version += 1
        moved = self.model + torch.randn(N, generator=self.generator)
        self.model = torch.where(self.mask, moved, self.model)
        flips = torch.rand(N, generator=self.generator) < 0.05
        self.mask = self.mask ^ flips
        halved = (torch.rand(N, generator=self.generator) < 0.02).nonzero().flatten()
        self.periods = halve(self.periods.clone(), halved)
        tensors = {"model": self.model, "mask": self.mask, "periods": self.periods}
        self.server.publish(self.version, tensors)

    def deliver(self, node: int, confirm: bool = True) -> tuple[dict[str, torch.Tensor], str]:
        records, _ = self.server.records(node, LAYOUT)
        content = RecordDict(records)
        state = self.states.setdefault(node, RecordDict())
        got = self.client.receive(content, state, LAYOUT)
        if confirm:
            self.server.confirm(node, self.version)
        return got, str(records["sync"]["model"])

    def check(self, got: dict[str, torch.Tensor]) -> None:
        assert torch.equal(got["model"], self.model)
        assert torch.equal(got["mask"], self.mask)
        assert torch.equal(got["periods"], self.periods)


def test_copies_stay_exact_across_gaps_and_pick_the_cheapest_form() -> None:
    world = World()
    world.step()
    got, form = world.deliver(0)
    world.check(got)
    assert form == "dense"  # nothing held yet
    world.step()
    got, form = world.deliver(0)  # one version behind: the values its old mask says
    world.check(got)
    assert form == "within-old"
    for _ in range(3):
        world.step()
    got, _ = world.deliver(0)  # three behind: changes since, in the cheapest form
    world.check(got)


def test_in_sync_client_gets_only_last_rounds_values_and_halved_indices() -> None:
    world = World()
    world.step()
    world.deliver(0)
    held_mask = world.mask.clone()
    world.step()
    records, base = world.server.records(0, LAYOUT)
    assert base == 1
    traffic = payload_traffic(RecordDict(records))
    halved = int((world.periods != world.server.versions[1]["periods"]).sum())
    flips = int((world.mask != held_mask).sum())
    assert traffic.payload == 4 * int(held_mask.sum())  # values at the held mask, no positions
    # halved periods as indices; mask flips as indices or the whole bitmap, what is cheaper,
    # each deflated where that is smaller still
    assert 0 < traffic.control <= 4 * halved + min(4 * flips, N // 8)
    assert records["sync"]["periods"] in ("advance", "bitmap")


def test_new_client_gets_periods_that_differ_from_the_initial_value() -> None:
    world = World()
    for _ in range(3):
        world.step()
    records, base = world.server.records(7, LAYOUT)
    assert base == -1
    assert records["sync"]["periods"] in ("indices", "bitmap")
    got = world.client.receive(RecordDict(records), RecordDict(), LAYOUT)
    world.check(got)


def test_client_given_up_on_gets_changes_from_its_confirmed_version() -> None:
    world = World()
    world.step()
    world.deliver(0)
    for _ in range(2):  # two rounds its reply misses the close: v1 stays confirmed
        world.step()
        _, form = world.deliver(0, confirm=False)
        assert form != "dense"
    world.step()  # this round's message never reaches it (it holds v3 and its base v1)
    world.step()
    got, form = world.deliver(0)
    assert world.server.records(0, LAYOUT)[1] == 5
    assert form != "dense" and world.states[0]["sync-held"]["base"] == 1
    world.check(got)
    world.step()
    got, form = world.deliver(0)  # confirmed again: one version behind
    assert form == "within-old"
    world.check(got)


def test_client_holding_neither_copy_refuses_and_is_resynced() -> None:
    world = World()
    world.step()
    world.deliver(0)
    world.step()
    world.states[0] = RecordDict()  # the client lost its state (a restarted device)
    records, _ = world.server.records(0, LAYOUT)
    with pytest.raises(RuntimeError, match="does not hold version 1"):
        world.client.receive(RecordDict(records), world.states[0], LAYOUT)
    world.server.forget(0)  # what the strategy does with the failed reply
    got, form = world.deliver(0)
    assert form == "dense"
    world.check(got)


def test_lazy_positions_send_only_what_is_needed_now() -> None:
    specs = (
        Synced("model", payload=True, within="mask", needed="mask"),
        Synced("mask", dtype=torch.bool, initial=lambda n: torch.ones(n, dtype=torch.bool)),
    )
    world = World(specs)
    server, client, state = world.server, world.client, RecordDict()

    def publish() -> None:
        world.version += 1
        server.publish(world.version, {"model": world.model, "mask": world.mask})

    publish()
    client.receive(RecordDict(server.records(0, LAYOUT)[0]), state, LAYOUT)
    server.confirm(0, world.version)
    for _ in range(4):  # the client is away while half the scalars are frozen
        world.model = torch.where(world.mask, world.model + 1, world.model)
        world.mask = torch.rand(N, generator=world.generator) < 0.5
        publish()
    records, _ = server.records(0, LAYOUT)
    got = client.receive(RecordDict(records), state, LAYOUT)
    active = world.mask
    assert torch.equal(got["model"][active], world.model[active])  # exact where it trains
    assert payload_traffic(RecordDict(records)).payload <= 4 * int(active.sum())


def test_versions_nobody_holds_are_dropped_and_state_round_trips() -> None:
    world = World()
    for _ in range(5):
        world.step()
    assert set(world.server.versions) == {5}
    world.deliver(0)
    world.step()
    assert set(world.server.versions) == {5, 6}
    restored = SyncServer(SPECS)
    restored.load_state_dict(world.server.state_dict())
    assert restored.records(0, LAYOUT)[1] == 5


def test_malformed_sync_records_are_codec_errors() -> None:
    world = World()
    world.step()
    world.deliver(0)
    world.step()
    records, _ = world.server.records(0, LAYOUT)
    bad = dict(records)
    bad["sync"] = ConfigRecord({**records["sync"], "periods": "advance"})
    bad["sync-control"] = ArrayRecord(
        {
            **{k: v for k, v in records["sync-control"].items() if not k.startswith("periods")},
            "periods.indices": numpy_to_array(np.array([5, 3], dtype=np.int32)),
        }
    )
    with pytest.raises(CodecError, match="increasing"):
        world.client.receive(RecordDict(bad), world.states[0], LAYOUT)
    with pytest.raises(CodecError, match="no 'sync' record"):
        world.client.receive(RecordDict(), world.states[0], LAYOUT)


def test_control_arrays_are_deflated_only_when_smaller_and_inflate_within_bounds() -> None:
    sparse_bits = np.packbits(np.arange(8000) % 97 == 0)  # a bitmap of few changes
    noise = np.random.default_rng(0).integers(0, 2**31, 200, dtype=np.int32)
    arrays = pack({"bits": sparse_bits, "noise": noise})
    assert set(arrays) == {"bits.z", "noise"}  # random indices do not shrink: sent plain
    assert packed_bytes(arrays) < sparse_bits.nbytes + noise.nbytes
    record = ArrayRecord(arrays)
    assert np.array_equal(unpack(record, "bits", np.dtype(np.uint8), 1000), sparse_bits)
    assert np.array_equal(unpack(record, "noise", np.dtype(np.int32), 200), noise)
    with pytest.raises(CodecError, match="inflates past"):  # a small stream, a huge result
        bomb = np.frombuffer(zlib.compress(bytes(10**6)), dtype=np.uint8)
        unpack(ArrayRecord({"x.z": numpy_to_array(bomb)}), "x", np.dtype(np.uint8), 1000)
    with pytest.raises(CodecError, match="not a zlib stream"):
        junk = numpy_to_array(np.arange(20, dtype=np.uint8))
        unpack(ArrayRecord({"x.z": junk}), "x", np.dtype(np.uint8), 1000)
    with pytest.raises(CodecError, match="expected uint8"):  # a plain array keeps its dtype
        unpack(record, "noise", np.dtype(np.uint8), 1000)
    with pytest.raises(CodecError, match="missing"):
        unpack(record, "other", np.dtype(np.int32), 1000)
