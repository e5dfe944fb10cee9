"""The GPU checks of issue 15 in one short script: passes without a GPU, exercises CUDA with one.

- the cluster client on CUDA (`clients.cluster.gpu_cluster_check`): NCCL ranks on two or
  more GPUs, else gloo ranks on CUDA tensors plus a one-rank NCCL all-reduce; the
  batch-weighted gradient must equal the full-batch one within 1e-6;
- CUDA tensors on the bulk side channel (`fl.transport.cuda_check.cuda_bulk_check`): a
  ResNet-18-sized state_dict through transport=grpc (and rdma where NIXL imports), bit-exact.

    .venv/bin/python experiments/gpu_check.py --json experiments/out/gpu_check.json

Exit status 0 when every check that could run passed; without CUDA both report a skip.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from clients.cluster import gpu_cluster_check
from fl.transport.cuda_check import cuda_bulk_check

GRADIENT_TOLERANCE = 1e-6


def _cluster_failures(result: dict[str, Any]) -> list[str]:
    """Names of the cluster checks whose gradient or weights drifted from one process's."""
    failures = []
    for name in ("nccl", "gloo_cuda"):
        check = result.get(name)
        if isinstance(check, dict) and "grad_max_abs_diff" in check:
            drift = max(check["grad_max_abs_diff"], check["weights_max_abs_diff"])
            if drift > GRADIENT_TOLERANCE:
                failures.append(f"{name}: max |diff| {drift:.2e} > {GRADIENT_TOLERANCE}")
        elif isinstance(check, dict) and check.get("nccl_one_rank_allreduce_ok") is False:
            failures.append(f"{name}: the one-rank NCCL all-reduce returned wrong values")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--size-mb", type=float, default=46.8, help="bulk payload size")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"cluster": gpu_cluster_check()}
    try:
        results["bulk"] = cuda_bulk_check(args.size_mb)
    except AssertionError as err:
        results["bulk"] = {"error": str(err)}
    failures = _cluster_failures(results["cluster"])
    if "error" in results["bulk"]:
        failures.append(f"bulk: {results['bulk']['error']}")
    results["failures"] = failures
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
