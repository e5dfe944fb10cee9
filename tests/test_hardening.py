"""Hostile or broken replies that pass every type check: the model survives them."""

import math
import mmap
import os

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fl.run.engines.local import LocalGrid
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.codec import CodecError, decode, encode, encode_dense
from fl.wire.contract import echo
from fl.wire.records import Layout, numpy_to_array
from strategies.asfl import ASFLParams, ASFLServer
from strategies.fedavg import FedAvgParams

GLOBAL = {"w": torch.linspace(-1, 1, 12).reshape(3, 4), "b": torch.zeros(4)}
LAYOUT = Layout.of(GLOBAL)


def _round(strategy: ServerStrategy, vectors, losses=None):
    """One round: every instruction answered with the given model vector and loss."""
    grid = LocalGrid(None, len(vectors), {})  # type: ignore[arg-type]  # nodes never called
    instructions = list(strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), grid))
    replies = []
    for i, (instruction, vector) in enumerate(zip(instructions, vectors, strict=True)):
        loss = 0.5 if losses is None else losses[i]
        metrics = MetricRecord({"num-examples": 10, "train-loss": loss, "samples": 10})
        content = {**encode_dense(vector, LAYOUT), "metrics": metrics}
        replies.append(Message(RecordDict(content), reply_to=instruction))
    return strategy.aggregate_train(1, replies)


def _fedavg(clients: int) -> ServerStrategy:
    return ServerStrategy(FedAvgParams(), seed=0, clients_per_round=clients)


def test_finite_values_whose_norm_overflows_are_rejected_under_the_defaults():
    honest = LAYOUT.flatten(GLOBAL) + 0.1
    huge = torch.full((LAYOUT.numel,), 3e38)  # each value finite, the norm is not
    strategy = _fedavg(2)
    arrays, _ = _round(strategy, [honest, huge])
    assert strategy.stats.rejected == 1 and "overflows" in strategy.stats.reasons[0]
    assert arrays is not None and torch.equal(LAYOUT.flatten(arrays.to_torch_state_dict()), honest)
    assert bool(torch.isfinite(strategy.global_vector).all())


def test_a_metric_that_is_not_finite_rejects_its_reply():
    vector = LAYOUT.flatten(GLOBAL) + 0.1
    for bad in (math.nan, math.inf, -math.inf):
        strategy = _fedavg(2)
        _round(strategy, [vector, vector], losses=[0.5, bad])
        assert strategy.stats.accepted == 1 and strategy.stats.rejected == 1
        assert "metric 'train-loss' is not finite" in strategy.stats.reasons[0]


def test_an_aggregate_that_is_not_finite_is_never_applied():
    class Overflowing(ServerStrategy):
        def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
            return super().aggregate(server_round, updates) * 1e39  # float32: inf

    strategy = Overflowing(FedAvgParams(), seed=0, clients_per_round=1)
    before = LAYOUT.flatten(GLOBAL)
    assert _round(strategy, [before + 0.1]) == (None, None)
    assert strategy.stats.skipped and torch.equal(strategy.global_vector, before)


def test_asfl_never_sees_a_nan_loss():
    params = ASFLParams()
    strategy = ASFLServer(params, seed=0, clients_per_round=2)
    vector = LAYOUT.flatten(GLOBAL) + 0.1
    _round(strategy, [vector, vector], losses=[math.nan, 0.5])
    assert strategy.stats.rejected == 1
    assert all(math.isfinite(u.metrics["train-loss"]) for u in strategy.stats.updates)


@pytest.mark.parametrize("chain", ["masked", "masked+q8", "sparse", "topk"])
def test_a_payload_with_an_extra_array_is_refused(chain):
    """APF and APF# (masked), FedSU and top-k strategies (sparse): nothing is dropped quietly."""
    vector, base = LAYOUT.flatten(GLOBAL) + 0.5, LAYOUT.flatten(GLOBAL)
    mask = torch.arange(LAYOUT.numel) % 2 == 0
    options = {
        "masked": {"mask": mask, "ship_mask": True},
        "sparse": {"indices": mask.nonzero()[:, 0]},
    }
    payload = encode(vector, chain, base=base, k=3, **options.get(chain.split("+")[0], {}))
    decode(payload, LAYOUT, base=base, mask=mask)  # as sent: accepted
    payload["arrays"]["smuggled"] = numpy_to_array(np.ones(3, dtype=np.float32))
    with pytest.raises(CodecError, match="smuggled"):  # q8: 'no array smuggled:scale'
        decode(payload, LAYOUT, base=base, mask=mask)


def test_a_download_segment_lent_read_only_cannot_be_written_through_a_reopen():
    from fl.net.transport.segments import Segment

    segment = Segment.create(2**20, peer_writes=False)
    try:
        with segment.view(4) as view:
            view[:4] = b"good"  # the agent's own mapping still writes (the next download)
        lent = os.open(f"/proc/self/fd/{segment.fd}", os.O_RDONLY)
        path = f"/proc/self/fd/{lent}"
        reopened = os.open(path, os.O_RDWR)  # what a hostile ClientApp would try
        try:
            with pytest.raises(PermissionError):
                os.pwrite(reopened, b"evil", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, 4, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        finally:
            os.close(reopened)
            os.close(lent)
        assert bytes(segment.memory[:4]) == b"good"
    finally:
        segment.close()


def _answer(strategy: ServerStrategy, instructions, replies_from):
    """Replies to `instructions` whose content (metrics included) is `replies_from`'s."""
    return [
        Message(RecordDict(dict(old.content.items())), reply_to=new)
        for new, old in zip(instructions, replies_from, strict=True)
    ]


def test_a_reply_from_an_earlier_round_is_refused_by_the_kernel():
    """pas, fedca, lbbsp, graft and asfl used to take it as current: the nonce it echoes
    names the earlier instruction, so every strategy refuses it."""
    strategy = _fedavg(2)
    grid = LocalGrid(None, 2, {})  # type: ignore[arg-type]
    vector = LAYOUT.flatten(GLOBAL) + 0.1
    first = list(strategy.configure_train(1, ArrayRecord(GLOBAL), ConfigRecord(), grid))
    replies = []
    for instruction in first:
        config = instruction.content.config_records["config"]
        metrics = MetricRecord(
            {"num-examples": 10, "train-loss": 0.5, "samples": 10, **echo(config)}
        )
        content = {**encode_dense(vector, LAYOUT), "metrics": metrics}
        replies.append(Message(RecordDict(content), reply_to=instruction))
    arrays, _ = strategy.aggregate_train(1, replies)
    assert strategy.stats.accepted == 2 and arrays is not None
    second = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    strategy.aggregate_train(2, _answer(strategy, second, replies))  # round 1's, replayed
    assert strategy.stats.accepted == 0 and strategy.stats.rejected == 2
    assert "answers another instruction" in strategy.stats.reasons[0]
