"""Run the APF example app on Flower's simulation (Ray): `python -m examples.apf_app.simulate`."""

from __future__ import annotations

import os

for key, value in {  # keep Flower and Ray offline
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(key, value)

from flwr.simulation import run_simulation  # noqa: E402

from examples.apf_app.app import NODES, clientapp, serverapp  # noqa: E402

if __name__ == "__main__":
    run_simulation(
        server_app=serverapp,
        client_app=clientapp,
        num_supernodes=NODES,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
