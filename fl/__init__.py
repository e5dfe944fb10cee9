"""Shared kernel of the framework: records, codecs, clock, data, models, engines, run.

Importing `fl` turns off Flower's and Ray's telemetry, update checks and runtime
dependency installation for this process and every process it starts, so nothing we
run phones home. It also checks that our other top-level packages (`server`, `clients`,
...) are ours, not a same-named module that shadows them (`fl.packaging`).
"""

import os

from fl.packaging import check_own_packages

OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
}
for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

check_own_packages()  # our generic package names are ours, or one clear ImportError

__all__ = ["OFFLINE_ENV"]
