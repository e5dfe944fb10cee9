"""A cluster client: one Flower client whose local training runs on N torch.distributed ranks.

Rank 0 is the ClientApp (a SuperNode's `flwr-clientapp` process, or any engine's call);
ranks 1..N-1 are workers that rank 0 starts on its machine for each train instruction,
or that `python -m clients.cluster workers` started once, on any machine, and that join
rank 0 at `cluster-master`. Every rank holds the client's data; each step's global batch
(the trainer's: same seeded permutation, same `batch_size` hook) is cut into per-rank
shares by a `RankBatchSampler`, each rank sums the loss gradient over its share, and one
all-reduce of [Σ_share ∇loss, b_i, loss_i, t_i] gives every rank the full-batch gradient
(LB-BSP's batch-weighted aggregation: the gradient, learning rate and so the trajectory
are a single process's). Rank 0's `ShareController` sizes the next step's shares from the
measured per-rank times: ∝ predicted speed (CPU; last value, EMA or NARX) or the
leader/straggler loop with memory caps (GPU), `fl.mechanisms.lbbsp`. gloo on CPU and in tests,
NCCL on GPUs (which uses InfiniBand/RoCE and GPUDirect by itself).

Turned on by the node config (`flower-supernode --node-config`): `cluster-ranks=N` (N ≥ 2),
optionally `cluster-backend` (gloo | nccl; default nccl where CUDA is), `cluster-controller`
(cpu | gpu), `cluster-predictor` (last | ema | narx), `cluster-caps` ("64,64": per-rank
batch caps, e.g. GPU memory), `cluster-slowdown` ("1,3": emulated per-rank slowdowns, for
demos and tests) and `cluster-master` (HOST:PORT where external workers wait). Without
`cluster-ranks` this ClientApp is `clients.app`'s. Launch: docs/DEPLOYMENT.md, section
"Cluster clients". The strategy's schedule hooks (lr, batch_size, after_step's stop)
run on rank 0 and reach every rank; hooks that change the model or its gradient
(FedProx's before_step, APF's roll-back) run on rank 0, which then re-broadcasts the model.

Layout: this module is the Flower side (the ClientApp and the `fl-cluster-client`
command line, which is also what a spawned worker runs); `clients.ranks` is the
torch.distributed side (config, shares, the ranks' training loop, both ends of a round);
`clients.cluster_check` holds the self-checks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from logging import INFO
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from clients import app as local
from clients.cluster_check import cluster_check, gpu_cluster_check
from clients.ranks import (
    ClusterConfig,
    Instruction,
    _worker_command,
    run_cluster_round,
    worker_main,
)
from clients.trainer import LocalResult
from fl.net.transport import bulk_mod
from fl.run.faults import fault_mod

__all__ = ["app", "main", "train"]

app = ClientApp(mods=[bulk_mod, fault_mod])  # as clients.app's: side channel, faults
app.query("info")(local.info)
app.evaluate()(local.evaluate)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round on the cluster (`cluster-ranks` ≥ 2), else `clients.app`'s local round."""
    config = ClusterConfig.from_node_config(context.node_config)
    if config is None:
        return local.train(msg, context)

    def on_ranks(
        prepared: local.Round, context: Context
    ) -> tuple[LocalResult, Callable[[], dict[str, Any]]]:
        if prepared.setup.dp is not None:
            raise ValueError("privacy=dpsgd does not run on a cluster client (per-rank clipping)")
        if prepared.settings.optimizer != "sgd":  # its state would live on rank 0 alone
            raise ValueError(
                f"optimizer={prepared.settings.optimizer} does not run on a "
                "cluster client (its ranks train with optimizer=sgd)"
            )
        instruction = Instruction(
            dict(context.run_config),
            prepared.partition,
            asdict(prepared.settings),
            config.slowdown,
            config.device,
        )
        started = time.perf_counter()
        result, shares = run_cluster_round(
            config, prepared.model, prepared.data, instruction, prepared.hooks
        )
        log(  # in the SuperNode's log: the round ran on the cluster, and how
            INFO,
            "cluster client: %d steps on %d %s ranks (%s), last shares %s, %.1f s",
            *(result.steps, config.ranks, config.backend, config.device, shares),
            time.perf_counter() - started,
        )
        shares_metrics = {f"cluster-share-{r}": s for r, s in enumerate(shares)}
        return result, lambda: {"cluster-ranks": config.ranks, **shares_metrics}

    return local.train_message(msg, context, on_ranks)


# ----- command line ----------------------------------------------------------------------
def _start_workers(args: argparse.Namespace) -> int:
    """`workers`: ranks first..N-1 on this machine, serving rank 0's rounds until stopped.

    Stopped by SIGTERM (kill, systemd, a test) as by Ctrl-C: it ends its ranks first
    (SIGTERM's default would leave them behind, waiting for rank 0 forever).
    """
    device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    config = ClusterConfig(args.ranks, args.backend, device=device)
    ranks = range(args.first_rank, args.ranks)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs += [subprocess.Popen(_worker_command(args.master, r, config, 0)) for r in ranks]
        return max(p.wait() for p in procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: Sequence[str] | None = None) -> int:
    """`fl-cluster-client` / `python -m clients.cluster`: workers and checks."""
    parser = argparse.ArgumentParser(prog="fl-cluster-client", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("worker", "workers"):
        one = sub.add_parser(
            name, help=f"run {'one worker rank' if name == 'worker' else 'ranks first..N-1'}"
        )
        one.add_argument("--master", required=True, help="HOST:PORT of rank 0 (cluster-master)")
        one.add_argument("--ranks", type=int, required=True, help="N, rank 0 included")
        one.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
        one.add_argument(
            "--device", default="", choices=("", "cpu", "cuda"), help="default: cuda for nccl"
        )
        if name == "worker":
            one.add_argument("--rank", type=int, required=True)
            one.add_argument("--rounds", type=int, default=0, help="0: until stopped")
        else:
            one.add_argument("--first-rank", type=int, default=1)
    check = sub.add_parser("check", help="real ranks vs one process (gradient, weights)")
    check.add_argument("--ranks", type=int, default=2)
    check.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    check.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    sub.add_parser("gpu-check", help="the NCCL check on CUDA (skips without a GPU)")
    args = parser.parse_args(argv)
    if args.command == "worker":
        host, port = args.master.rsplit(":", 1)
        worker_main(host, int(port), args.rank, args.ranks, args.backend, args.rounds, args.device)
        # Its rounds are served and its group destroyed: leave without the interpreter's
        # teardown, where torch's store and gloo threads can still abort the process
        # ("terminate called without an active exception", seen once in a suite run),
        # which rank 0 would read as a failed round.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.command == "workers":
        return _start_workers(args)
    result = (
        cluster_check(args.ranks, args.backend, args.device)
        if args.command == "check"
        else gpu_cluster_check()
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
