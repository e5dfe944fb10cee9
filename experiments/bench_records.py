"""A reply's records: our message path vs Flower's own constructors, side by side.

On the population benchmark's MLP 20-32-2, per operation, the minimum over `--repeats`
of the mean of `--calls` calls, in µs:

- encode: Flower's way, `ArrayRecord({name: Array(ndarray)})` of the state_dict plus a
  `ConfigRecord` of the codec's three fields; ours, `fl.wire.codec.encode_dense` (the same
  records, and their byte counts measured);
- decode: Flower's way, `ArrayRecord.to_torch_state_dict()` then `torch.cat`; ours,
  `fl.wire.codec.decode` (names, shapes, dtypes and sizes checked against the layout);
- measure: the bytes a message's arrays hold, `fl.wire.codec.payload_traffic`, against
  Flower's `ArrayRecord.count_bytes()`.

    .venv/bin/python experiments/bench_records.py [--calls 5000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl.wire.codec import decode, encode_dense, payload_traffic
from fl.wire.records import Layout
from fl.world.models import build_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the engine's torch_threads=1
    torch.manual_seed(0)
    model = build_model("mlp", (20,), 2, hidden=(32,))
    state = model.state_dict()
    layout = Layout.of(state)
    vector = layout.flatten(state)
    content = RecordDict(encode_dense(vector, layout))
    flowers = content["arrays"]
    assert isinstance(flowers, ArrayRecord)
    codec = {"name": "dense", "payload-bytes": 0, "control-bytes": 0}

    def flower_encode() -> object:
        arrays = ArrayRecord({name: Array(t.numpy()) for name, t in state.items()})
        return arrays, ConfigRecord(codec)

    def flower_decode() -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in flowers.to_torch_state_dict().values()])

    rows = {
        "encode": (flower_encode, lambda: encode_dense(vector, layout)),
        "decode": (flower_decode, lambda: decode(content, layout)),
        "measure": (flowers.count_bytes, lambda: payload_traffic(content)),
    }
    print("| op | Flower µs | ours µs | Flower ÷ ours |")
    print("|---|---|---|---|")
    for op, (reference, ours) in rows.items():
        us = [
            min(timeit.repeat(f, number=args.calls, repeat=args.repeats)) / args.calls * 1e6
            for f in (reference, ours)
        ]
        print(f"| {op} | {us[0]:.1f} | {us[1]:.1f} | {us[0] / us[1]:.1f}× |")


if __name__ == "__main__":
    main()
