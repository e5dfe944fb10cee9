"""The public API: what strategy plugins and scripts may import, named in one place.

Everything in `__all__` below (and the apps in `APPS`) is kept stable: a name that has to
change keeps working under its old form with a `DeprecationWarning` that names the
replacement, and docs/API.md lists every such change. Everything else in `fl/` is the
kernel's own and may move (moved modules still import by their old path, with a warning:
`fl.common.moved`). `tests/test_public_api.py` holds this module to docs/API.md.
"""

from __future__ import annotations

from fl.common.checkpointable import checkpointable
from fl.common.config import ConfigError, compose, to_run_config
from fl.common.errors import RunError
from fl.run.apps import Apps
from fl.run.engines import run_engine
from fl.run.engines.local import LocalGrid, run_local
from fl.run.validation import validate
from fl.strategy.client import ClientHooks, ClientTime, Reply
from fl.strategy.registry import StrategySpec, available, get_strategy, register
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.codec import CodecError, decode, encode_dense, encode_masked, register_codec
from fl.wire.contract import ContractMismatch, stamp
from fl.wire.records import Layout
from fl.wire.sync import SyncClient, Synced

__all__ = [
    "APPS",
    "Apps",
    "ClientHooks",
    "ClientTime",
    "ClientUpdate",
    "CodecError",
    "ConfigError",
    "ContractMismatch",
    "Layout",
    "LocalGrid",
    "Reply",
    "RunError",
    "ServerStrategy",
    "StrategySpec",
    "SyncClient",
    "Synced",
    "available",
    "checkpointable",
    "compose",
    "decode",
    "encode_dense",
    "encode_masked",
    "get_strategy",
    "register",
    "register_codec",
    "run_engine",
    "run_local",
    "stamp",
    "to_run_config",
    "validate",
]

# Public names outside `fl/` (which never imports them): our Flower apps, by the references
# `flwr run` and `Apps.load` use, and a strategy's client half in your own ClientApp.
APPS = ("server.app:app", "clients.app:app", "clients.hooked:train_with_hooks")
