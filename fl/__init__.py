"""Shared kernel of the framework: records, codecs, clock, data, models, engines, run.

Importing `fl` turns off Flower's and Ray's telemetry, update checks and runtime
dependency installation for this process and every process it starts, so nothing we
run phones home.
"""

import os

OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
}
for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

__all__ = ["OFFLINE_ENV"]
