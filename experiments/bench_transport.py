"""Bulk side channel vs Flower inline, and the streamed mean vs Flower's aggregation.

`python experiments/bench_transport.py --json OUT` (`make bench-transport`) runs, side by
side on 127.0.0.1:

1. A ResNet-18-sized model (46.8 MB float32, 122 tensors) server -> client -> server
   through a real SuperLink and SuperNode (`flwr run` of this file as a Flower App), one
   message at a time, `repeats` per mode (after one warm-up): `inline` (the model inside
   Flower's messages), `grpc` and `rdma` (the model on the side channel, `fl.net.transport`;
   rdma only where NIXL imports) through the node's bulk agent (`fl.net.transport.sidecar`,
   started beside the SuperNode as a deployment runs it: `bulk-agent=PATH` in the node
   config), and `grpc_process` and `rdma_process`, the same without the agent (each
   ClientApp process dials, and for rdma makes its own NIXL agent). Flower's polling (the
   SuperNode sleeps 3 s when idle, 0.5 s while its ClientApp works) and the start of a
   fresh ClientApp process per message are the same in every mode and are not the
   bytes' cost, so they are not counted; nor is the agent's start (once per node). What
   is counted, per message: the ServerApp's `push_messages` (inline: deflate, hash and
   upload the model to the SuperLink; bulk: pack, hash, publish, push a small message),
   its `pull_messages` call that returns the reply (download and inflate; bulk: plus
   checking the upload and rebuilding the arrays), and in the ClientApp the side channel's
   own time (fetch, check, unpack; pack, upload), timed around `bulk_mod`. For inline this
   leaves out the SuperNode's two legs (SuperLink -> SuperNode -> ClientApp and back),
   so `inline_s` is a lower bound of Flower's data path and the speedups are lower bounds.
   `inline_s`, `grpc_s`, `rdma_s`, `grpc_process_s`, `rdma_process_s`: medians of those
   sums (modes interleaved message by message); `load_avg`: the 1-minute load average at
   the start and the end, `round_trip_load_avg`: before each counted message, per mode;
   `bulk_fallbacks`: per mode, arrays that went inline instead (0 when all went aside).
2. The aggregation of 10 such replies: ours (`fl.wire.streaming.streamed_weighted_mean` on the
   decoded vectors, what `ServerStrategy.aggregate` does: `aggregate_gbps`; and from the
   replies' ArrayRecords to the new global ArrayRecord, decoding and encoding included, as
   Flower's function does: `aggregate_records_gbps`, `fl.wire.streaming.streamed_record_mean`
   reading the replies in place and writing the mean straight into the new record's bytes;
   `aggregate_decoded_records_gbps`: the same through decoded vectors, the path before
   issue 37), Flower's `aggregate_arrayrecords` on the ArrayRecords, and memcpy (np.copyto
   of every reply into one buffer): GB/s of reply bytes read, medians over repeats (after
   one untimed pass of every arm) with their range, the arms alternating within each repeat
   and the load recorded before it, and each arm's median CPU seconds (every arm runs on one
   thread; the arms from records allocate their output afresh on every call, from the same
   process's heap, so first-touch costs fall alike). The headline,
   `headline_aggregation_vs_flower`, is the like-for-like ratio (records in, record out on
   both sides; `headline_aggregation_vs_flower_cpu`: the same in CPU seconds);
   `aggregate_speedup` (the kernel on decoded vectors) starts later than Flower's function
   and is not a fair comparison on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from fl.common.files import write_atomic

HERE = Path(__file__).resolve()
BIN = Path(sys.executable).parent
OFFLINE = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
}
REPLIES = 10
MODES = ("inline", "grpc", "rdma", "grpc_process", "rdma_process")
GOALS = {"grpc": 8.0, "rdma": 40.0, "grpc_process": 8.0, "rdma_process": 40.0}  # × inline


def model_shapes(mb: float) -> list[tuple[str, tuple[int, ...]]]:
    """ResNet-18's state_dict shapes (46.8 MB in float32); other sizes: one matrix."""
    if abs(mb - 46.8) < 0.05:
        import torchvision

        return [(k, tuple(v.shape)) for k, v in torchvision.models.resnet18().state_dict().items()]
    return [("w", (int(mb * 1e6 / 4 / 1000), 1000))]


def model(mb: float, seed: int) -> dict[str, np.ndarray]:
    """Fresh contents every call: Flower stores objects by content hash, so a repeated
    model would not travel again."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in model_shapes(mb)}


# ----- the Flower App (loaded by the SuperLink and SuperNode from a copy of this file) -----

try:  # (the launcher below needs none of this)
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from fl.net.transport import BulkGrid, TransportSettings, bulk_mod, nixl_available
    from fl.net.transport.links import NODE_CONFIG_KEY
    from fl.wire.records import array_to_numpy, numpy_to_array

    def timed_bulk_mod(msg: Message, context: Context, call_next: Any) -> Message:
        """`bulk_mod`, its own seconds (all it does but the handler) added to the reply;
        without the node's bulk agent when the message's `bench` config says `process`."""
        if str(msg.content["bench"]["link"]) == "process":
            config = {k: v for k, v in context.node_config.items() if k != NODE_CONFIG_KEY}
            context = Context(
                context.run_id, context.node_id, config, context.state, context.run_config
            )
        start = time.perf_counter()
        reply = bulk_mod(msg, context, call_next)
        metrics = reply.content["metrics"]
        metrics["bulk-s"] = time.perf_counter() - start - float(metrics["handler-s"])
        return reply

    client = ClientApp(mods=[timed_bulk_mod])
    server = ServerApp()

    @client.train()
    def echo(msg: Message, context: Context) -> Message:
        """Return the model plus one, with the handler's own seconds."""
        start = time.perf_counter()
        arrays = msg.content["arrays"]
        out = {k: numpy_to_array(array_to_numpy(v) + 1) for k, v in arrays.items()}
        metrics = MetricRecord({"handler-s": time.perf_counter() - start})
        return Message(RecordDict({"arrays": ArrayRecord(out), "metrics": metrics}), reply_to=msg)

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        """`repeats` + 1 messages per mode, one at a time; timings to the config's `out`."""
        cfg = context.run_config
        repeats, mb = int(cfg["repeats"]), float(cfg["mb"])
        while not list(grid.get_node_ids()):
            time.sleep(0.1)
        (node,) = grid.get_node_ids()
        grids: dict[str, Grid] = {"inline": grid}
        modes = {"inline": ("inline", "agent")}  # mode -> (grid, the node's link)
        for kind in ("grpc", "rdma"):
            if kind == "grpc" or nixl_available() is None:
                grids[kind] = BulkGrid(grid, TransportSettings(name=kind, min_bytes=1))
                modes |= {kind: (kind, "agent"), f"{kind}_process": (kind, "process")}
        results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        loads: dict[str, list[float]] = {mode: [] for mode in modes}  # 1-min load before each
        fallbacks = dict.fromkeys(modes, 0)  # arrays that went inline instead (should be none)
        seed = 0
        for _ in range(repeats + 1):  # modes interleaved; the first round is a warm-up
            for mode, (kind, link) in modes.items():
                seed += 1
                arrays = {k: numpy_to_array(v) for k, v in model(mb, seed).items()}
                target = grids[kind]
                load = os.getloadavg()[0]
                results[mode].append(_round_trip(target, node, ArrayRecord(arrays), link))
                loads[mode].append(load)
                if isinstance(target, BulkGrid):
                    fallbacks[mode] += target.diagnostics()["bulk_fallbacks"]
        for bulk in grids.values():
            if isinstance(bulk, BulkGrid):
                bulk.close()
        warm = {mode: rows[1:] for mode, rows in results.items()}
        warm_loads = {mode: values[1:] for mode, values in loads.items()}
        Path(str(cfg["out"])).write_text(
            json.dumps({"rows": warm, "loads": warm_loads, "fallbacks": fallbacks})
        )

    def _round_trip(grid: Grid, node: int, arrays: ArrayRecord, link: str) -> dict[str, float]:
        """One message there and back: push, the reply's pull, the node's side channel."""
        content = RecordDict({"arrays": arrays, "bench": ConfigRecord({"link": link})})
        start = time.perf_counter()
        (mid,) = grid.push_messages([Message(content, node, "train")])
        push_s = time.perf_counter() - start
        while True:  # polling Flower: not counted
            start = time.perf_counter()
            replies = list(grid.pull_messages([mid]))
            if replies:
                pull_s = time.perf_counter() - start
                break
            time.sleep(0.005)
        (reply,) = replies
        if reply.has_error():
            raise RuntimeError(f"the echo failed: {reply.error.reason}")
        metrics = reply.content["metrics"]
        return {"push_s": push_s, "pull_s": pull_s, "node_bulk_s": float(metrics["bulk-s"])}

except ImportError:  # pragma: no cover
    pass


# ----- the launcher --------------------------------------------------------------------------


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def _wait_path(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[0]} made no {path} (exit code {proc.returncode})")
        time.sleep(0.1)


def flower_round_trips(mb: float, repeats: int, root: Path) -> dict[str, Any]:
    """Run the App above on a SuperLink and one SuperNode (with its bulk agent) on
    127.0.0.1: per mode the timed rows, and the count of inline fallbacks."""
    app = root / "app"
    app.mkdir()
    shutil.copy(HERE, app / "bench_app.py")
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "bench-transport"\nversion = "1.0.0"\n'
        '[tool.flwr.app]\npublisher = "adaptive-fl"\n'
        '[tool.flwr.app.components]\nserverapp = "bench_app:server"\n'
        'clientapp = "bench_app:client"\n'
        '[tool.flwr.app.config]\nrepeats = 1\nmb = 1.0\nout = ""\n'
    )
    link_port, node_port = _free_ports(2)
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    out = root / "flower.json"
    with ExitStack() as stack:
        procs: list[subprocess.Popen[bytes]] = []
        stack.callback(lambda: [p.terminate() for p in procs] and [p.wait(30) for p in procs])

        def start(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
            home = root / name
            home.mkdir(exist_ok=True)
            env = {**os.environ, **OFFLINE, "FLWR_HOME": str(home), "PATH": path}
            log = stack.enter_context((root / f"{name}.log").open("wb"))
            proc = subprocess.Popen(cmd, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs.append(proc)
            return proc

        link = start(
            "superlink",
            # (no --database: Flower's default, in-memory state, its fastest)
            [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
             "--port", str(link_port)],
        )  # fmt: skip
        _wait_port(link_port, link)
        agent_socket = root / "bulk-agent.sock"  # the node's bulk agent, beside its SuperNode
        sidecar = start(
            "bulk-agent",
            [sys.executable, "-m", "fl.net.transport.sidecar", "--socket", str(agent_socket)],
        )
        _wait_path(agent_socket, sidecar)
        start(
            "supernode",
            [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
             "--port", str(node_port), "--node-config",
             f'partition-id=0 num-partitions=1 bulk-agent="{agent_socket}"'],
        )  # fmt: skip
        cli = root / "cli"
        cli.mkdir()
        (cli / "config.toml").write_text(
            f'[superlink]\ndefault = "bench"\n[superlink.bench]\naddress = "127.0.0.1:{link_port}"'
            "\ninsecure = true\n"
        )
        config = root / "run.toml"
        config.write_text(f'repeats = {repeats}\nmb = {mb}\nout = "{out}"\n')
        run = start(  # FLWR_HOME: cli/, the config above
            "cli", [str(BIN / "flwr"), "run", str(app), "bench", "-c", str(config), "--stream"]
        )
        deadline = time.monotonic() + 1800
        while run.poll() is None and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs if p is not run):
                break  # (a SuperNode that cannot start leaves the ServerApp waiting forever)
            time.sleep(1)
        if not out.exists():
            logs = "".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in root.glob("*.log"))
            raise RuntimeError(f"the Flower run wrote no results:\n{logs}")
    return json.loads(out.read_text())


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def aggregation(mb: float, repeats: int) -> dict[str, float]:
    """GB/s of reply bytes: ours, Flower's aggregate_arrayrecords, memcpy."""
    import torch
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from fl.wire.records import Layout, arrays_to_vector, numpy_to_array, vector_to_arrays
    from fl.wire.streaming import streamed_record_mean, streamed_weighted_mean

    torch.set_num_threads(1)  # as every run pins it (torch_threads: 1); NumPy is single-threaded
    replies = [model(mb, 1000 + i) for i in range(REPLIES)]
    counts = [100 + 37 * i for i in range(REPLIES)]
    records = [
        RecordDict(
            {
                "arrays": ArrayRecord({k: numpy_to_array(v) for k, v in reply.items()}),
                "metrics": MetricRecord({"num-examples": n}),
            }
        )
        for reply, n in zip(replies, counts, strict=True)
    ]
    layout = Layout.of({k: torch.from_numpy(v) for k, v in replies[0].items()})
    vectors = [arrays_to_vector(r["arrays"], layout) for r in records]  # as check_reply decodes
    weights = torch.tensor(counts, dtype=torch.float64)
    total = sum(v.numel() * 4 for v in vectors)
    buffer = np.empty(vectors[0].numel(), dtype=np.float32)

    def memcpy() -> None:
        for vector in vectors:
            np.copyto(buffer, vector.numpy())

    def ours_from_records() -> None:  # records in, record out, as Flower's function
        counts = torch.tensor([r["metrics"]["num-examples"] for r in records])
        streamed_record_mean([r.array_records["arrays"] for r in records], counts, layout)

    def ours_decoded_records() -> None:  # the same, through decoded vectors (the old path)
        decoded = [arrays_to_vector(r.array_records["arrays"], layout) for r in records]
        vector_to_arrays(streamed_weighted_mean(decoded, weights), layout)

    arms = {
        "aggregate_records": ours_from_records,  # like for like with Flower's: the headline
        "aggregate_decoded_records": ours_decoded_records,
        "flower_aggregate": lambda: aggregate_arrayrecords(records, "num-examples"),
        "aggregate": lambda: streamed_weighted_mean(vectors, weights),  # the kernel alone
        "memcpy": memcpy,
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    loads: list[float] = []
    for run in arms.values():  # one untimed pass: one-time imports and compiles out of every timer
        run()
    for _ in range(repeats):  # arms alternate, so a change of load hits every arm alike
        loads.append(os.getloadavg()[0])
        for name, run in arms.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    out: dict[str, Any] = {"aggregation_load_avg": loads}
    for name, seconds in times.items():
        out[f"{name}_gbps"] = total / _median(seconds) / 1e9
        out[f"{name}_gbps_range"] = [total / max(seconds) / 1e9, total / min(seconds) / 1e9]
        out[f"{name}_cpu_s"] = _median(cpu[name])  # one thread in every arm: CPU s ~ wall
    return out


def summarise(rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per mode the median of the counted seconds, and of each part."""
    out: dict[str, Any] = {}
    for mode in MODES:
        out[f"{mode}_s"] = _median([sum(r.values()) for r in rows[mode]]) if mode in rows else None
        for part in ("push_s", "pull_s", "node_bulk_s"):
            if mode in rows:
                out[f"{mode}_{part}"] = _median([r[part] for r in rows[mode]])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--mb", type=float, default=46.8, help="model size (46.8: ResNet-18)")
    parser.add_argument("--repeats", type=int, default=5, help="messages per mode (medians)")
    parser.add_argument(
        "--aggregation-only", action="store_true", help="part 2 only: no SuperLink round trips"
    )
    args = parser.parse_args(argv)
    load = [os.getloadavg()[0]]
    flower: dict[str, Any] = {"rows": {}, "fallbacks": {}, "loads": {}}
    if not args.aggregation_only:
        with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmp:
            flower = flower_round_trips(args.mb, args.repeats, Path(tmp))
    rows = flower["rows"]
    load.append(os.getloadavg()[0])
    result: dict[str, Any] = {
        "mb": args.mb,
        "repeats": args.repeats,
        "load_avg": load,
        "nixl": nixl_available() or "imports",  # why NIXL does not import, if it does not
        **summarise(rows),
        "bulk_fallbacks": flower["fallbacks"],
        **aggregation(args.mb, args.repeats),
        "rows": rows,
    }
    for mode, goal in GOALS.items():
        value = result[f"{mode}_s"]
        result[f"{mode}_speedup"] = result["inline_s"] / value if value else None
        result[f"{mode}_goal"] = goal
    for key in ("aggregate", "aggregate_records", "aggregate_decoded_records"):
        result[f"{key}_speedup"] = result[f"{key}_gbps"] / result["flower_aggregate_gbps"]
    # the headline compares like with like: ArrayRecords in, ArrayRecord out on both sides
    result["headline_aggregation_vs_flower"] = result["aggregate_records_speedup"]
    result["headline_aggregation_vs_flower_cpu"] = (
        result["flower_aggregate_cpu_s"] / result["aggregate_records_cpu_s"]
    )
    result["round_trip_load_avg"] = flower["loads"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.json, json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
