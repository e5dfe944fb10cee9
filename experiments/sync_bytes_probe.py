"""Where a sync strategy's download goes: per round, the bytes `fl.wire.sync` sends to clients
it resyncs dense (holding nothing confirmed: first contact, a failed or rejected reply; before
9ecafde also a reply that missed the close) and to the others.

    python experiments/sync_bytes_probe.py --out experiments/out/sync_bytes.json \
        experiment=fedca_room strategy=fedca_plus seed=0 time_budget_s=60 \
        hydra.sweep.dir=experiments/out/sync_bytes

Wraps `SyncServer.records` around one in-process `fl-run` (the overrides after the options);
each row: round, dense messages, their payload and control bytes (`fl.wire.codec.payload_traffic`,
as the run's traffic is measured), then the same for the diffs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from flwr.app import RecordDict

from fl.common.files import write_atomic
from fl.run import cli
from fl.wire import sync
from fl.wire.codec import payload_traffic


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the rows, as JSON")
    parser.add_argument("overrides", nargs="+", help="fl-run's Hydra overrides")
    args = parser.parse_args(argv)
    sent: dict[int, list[tuple[bool, int, int]]] = defaultdict(list)
    records = sync.SyncServer.records

    def counted(self: sync.SyncServer, node: int, layout: Any) -> tuple[dict[str, Any], int]:
        out, base = records(self, node, layout)
        traffic = payload_traffic(RecordDict(out))  # as the loop measures a message
        sent[self.current].append((base == sync.NONE, traffic.payload, traffic.control))
        return out, base

    sync.SyncServer.records = counted  # type: ignore[method-assign]
    sys.argv = ["fl-run", *args.overrides, "progress=false", "plots=false"]
    try:
        cli.main()
    except SystemExit as end:
        if end.code:
            raise
    rows = [
        [version, *_totals([m for m in ms if m[0]]), *_totals([m for m in ms if not m[0]])]
        for version, ms in sorted(sent.items())
    ]
    write_atomic(args.out, json.dumps(rows))


def _totals(messages: list[tuple[bool, int, int]]) -> list[int]:
    """How many messages, their payload bytes and their control-state bytes."""
    return [len(messages), sum(m[1] for m in messages), sum(m[2] for m in messages)]


if __name__ == "__main__":
    main()
