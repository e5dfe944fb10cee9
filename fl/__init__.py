"""Shared kernel of the framework, in floors that import only downwards.

`run` (entry point, engines, loops, tracking) > `net` (TLS, gate, bulk transport) >
`strategy` (the contract an algorithm implements) > `mechanisms` (what strategies
compose) > `world` (clock, data, models, tasks) > `wire` (records, codecs, sync) >
`common` (errors, seeds, config access). `make lint` holds the floors to this order.
`fl.api`, above them all, names what plugins and scripts may import (docs/API.md).

Importing `fl` turns off Flower's and Ray's telemetry, update checks and runtime
dependency installation for this process and every process it starts, so nothing we
run phones home. It also checks that our other top-level packages (`server`, `clients`,
...) are ours, not a same-named module that shadows them (`fl.common.packaging`).
"""

import os

from fl.common import moved
from fl.common.packaging import check_own_packages

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
moved.install()  # old flat import paths (fl.hooks, fl.registry, ...) still resolve

__all__ = ["OFFLINE_ENV"]
