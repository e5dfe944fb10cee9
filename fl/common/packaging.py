"""Our generic top-level package names must resolve to our own packages, or fail fast.

One distribution (adaptive-fl) installs the design card's folders as top-level import
packages: `fl`, `strategies`, `server`, `clients`, `privacy` (and `hydra_plugins.adaptive_fl`
in Hydra's namespace). Generic names can be shadowed: a `server.py` in the working
directory or in a Flower app's folder (which Flower puts first on `sys.path`), or another
distribution's `server` package. Python would then import the stranger's module and fail
far from the cause; `check_own_packages` (run when `fl` is imported) names it instead.
docs/PACKAGING.md explains the choice of names.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["OWN_PACKAGES", "check_own_packages", "foreign_packages"]

OWN_PACKAGES = ("strategies", "server", "clients", "privacy")  # `fl` is the one importing this
ROOT = Path(__file__).resolve().parents[2]  # the folder holding fl/, server/, clients/, ...


def foreign_packages() -> dict[str, str]:
    """Our package names that resolve to something outside our installation: name -> path."""
    foreign = {}
    for name in OWN_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None:  # not installed (e.g. a lean client without the server half)
            continue
        origin = spec.origin or next(iter(spec.submodule_search_locations or []), None)
        if origin is None or Path(origin).resolve() != ROOT / name / "__init__.py":
            foreign[name] = str(origin)
    return foreign


def check_own_packages() -> None:
    """Raise ImportError naming the first of our package names that something shadows."""
    foreign = foreign_packages()
    if foreign:
        name, where = next(iter(foreign.items()))
        raise ImportError(
            f"adaptive-fl: the top-level package {name!r} resolves to {where}, not to "
            f"{ROOT / name}; rename that module or run from another directory "
            "(docs/PACKAGING.md)"
        )
