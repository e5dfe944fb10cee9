"""Old import paths of `fl`'s modules, from before `fl/` was split into floors.

`import fl.hooks` (or `fl.registry`, `fl.codec`, `fl.clock`, ...) still works: a finder on
`sys.meta_path` hands back the module at its new path, the very same module object, with a
`DeprecationWarning` naming that path. Plugins written against the flat layout keep
loading; new code imports the new paths (docs/ARCHITECTURE.md). Checkpoints written before
the move name their state classes by the old paths; `old_names` lets the checkpoint
unpickler accept those names too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "MOVED_CLASSES", "install", "new_path", "old_names"]

# old dotted path -> new dotted path (a submodule of an old package follows its package)
MOVED: dict[str, str] = {
    "fl.errors": "fl.common.errors",
    "fl.seeding": "fl.common.seeding",
    "fl.state": "fl.common.checkpointable",
    "fl.packaging": "fl.common.packaging",
    "fl.config": "fl.common.config",
    **{f"fl.{m}": f"fl.wire.{m}" for m in ("records", "packing", "masking", "sync")},
    **{f"fl.{m}": f"fl.wire.{m}" for m in ("streaming", "contract", "grids", "codec")},
    **{f"fl.{m}": f"fl.world.{m}" for m in ("clock", "population", "data", "partition")},
    **{f"fl.{m}": f"fl.world.{m}" for m in ("procedural", "models", "task")},
    **{f"fl.{m}": f"fl.mechanisms.{m}" for m in ("diagnosis", "speculation", "actions")},
    **{f"fl.{m}": f"fl.mechanisms.{m}" for m in ("laws", "lbbsp", "roundrobin", "sac", "robust")},
    "fl.tls": "fl.net.tls",
    "fl.gate": "fl.net.gate",
    "fl.transport": "fl.net.transport",
    "fl.hooks": "fl.strategy.client",
    "fl.registry": "fl.strategy.registry",
    **{f"fl.{m}": f"fl.run.{m}" for m in ("loops", "faults", "attacks", "tracking", "console")},
    **{f"fl.{m}": f"fl.run.{m}" for m in ("plots", "compare", "engines")},
}
# classes that moved to another module than their old module's new path: new -> old name
MOVED_CLASSES = {"fl.mechanisms.diagnosis.LinearityTest": "fl.speculation.LinearityTest"}


def new_path(old: str) -> str | None:
    """Where the module once at `old` lives now (None: it did not move)."""
    head, _, tail = old.partition(".")
    while True:
        if old in MOVED:
            return MOVED[old]
        if head in MOVED:
            return MOVED[head] + old[len(head) :]
        if not tail:
            return None
        nxt, _, tail = tail.partition(".")
        head = f"{head}.{nxt}"


def old_names(classes: list[type]) -> list[tuple[type, str]]:
    """(class, its dotted name before the move) for each of `classes` that had another
    name: what `torch.serialization.safe_globals` takes to accept both names."""
    old_modules = {new: old for old, new in MOVED.items()}
    names = []
    for cls in classes:
        new = f"{cls.__module__}.{cls.__qualname__}"
        if new in MOVED_CLASSES:
            names.append((cls, MOVED_CLASSES[new]))
        elif cls.__module__ in old_modules:
            names.append((cls, f"{old_modules[cls.__module__]}.{cls.__qualname__}"))
    return names


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path (one object under both names)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when imported under its new path."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_path(fullname) if fullname.startswith("fl.") else None
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder first on `sys.meta_path`, once. First, because `fl.codec.core` would
    otherwise be found by the path finder inside the aliased package's folder and run a
    second time as another module; no real module lives at an old path."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
