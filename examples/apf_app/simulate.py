"""Run the APF example app: `python -m examples.apf_app.simulate [--local]`.

Without options, on Flower's simulation (Ray); with `--local`, the same two apps on our
in-process grid (`fl.api.LocalGrid`: one process, no Ray, seconds). A run whose halves do
not match ends with one line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os

for key, value in {  # keep Flower and Ray offline
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(key, value)

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from examples.apf_app.app import NODES, clientapp, serverapp  # noqa: E402
from fl.api import LocalGrid, RunError  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", action="store_true", help="in-process grid instead of Ray")
    args = parser.parse_args(argv)
    try:
        if args.local:
            grid = LocalGrid(clientapp, NODES, {})
            serverapp(grid, Context(1, 0, {}, RecordDict(), {}))
            return
        run_simulation(
            server_app=serverapp,
            client_app=clientapp,
            num_supernodes=NODES,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    except RunError as err:  # mismatched halves: ContractMismatch
        raise SystemExit(f"apf-example: {err}") from None


if __name__ == "__main__":
    main()
