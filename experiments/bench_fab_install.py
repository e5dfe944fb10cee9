"""What each ClientApp process pays to install the App before it runs (flwr 1.42).

A SuperNode starts one `flwr-clientapp` process per message, and each calls Flower's
`install_from_fab`: it unpacks the FAB into a temporary folder and re-hashes every file
against the FAB's manifest before it finds the App already installed. This script builds
two FABs from the checkout, ours (`[tool.flwr.app] fab-include`: the packages the apps
import and the Hydra config; the records, docs, tests and examples stay behind) and Flower's
default packing of the same files (the same pyproject without `fab-include`), and times
that re-install alternately on each: medians, their ratio and the machine's load. Both
sides call the same function on an App installed once beforehand, as a SuperNode's second
and later messages do.

    .venv/bin/python experiments/bench_fab_install.py --repeats 15
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w
from flwr.cli.build import build_fab_from_disk
from flwr.cli.install import install_from_fab

from fl.common.files import write_atomic
from fl.run.engines.deployment import staged_app


def default_packing(app: Path, into: Path) -> Path:
    """A copy of the staged App whose pyproject has no `fab-include` (Flower's defaults)."""
    shutil.copytree(app, into)
    pyproject = into / "pyproject.toml"
    config = tomllib.loads(pyproject.read_text())
    config["tool"]["flwr"]["app"].pop("fab-include")
    pyproject.write_text(tomli_w.dumps(config))
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with staged_app() as app, tempfile.TemporaryDirectory() as tmp:
        fabs = {
            "ours": build_fab_from_disk(app),
            "flower_default": build_fab_from_disk(default_packing(app, Path(tmp) / "default")),
        }
        homes = {arm: Path(tmp) / f"home-{arm}" for arm in fabs}
        for arm, fab in fabs.items():
            install_from_fab(fab, homes[arm], skip_prompt=True)  # the first message's install
        times: dict[str, list[float]] = {arm: [] for arm in fabs}
        loads = [os.getloadavg()[0]]
        for _ in range(args.repeats):
            for arm, fab in fabs.items():
                start = time.perf_counter()
                install_from_fab(fab, homes[arm], skip_prompt=True)
                times[arm].append(time.perf_counter() - start)
        loads.append(os.getloadavg()[0])
    median = {arm: statistics.median(values) for arm, values in times.items()}
    out = {
        "fab_bytes": {arm: len(fab) for arm, fab in fabs.items()},
        "reinstall_median_s": median,
        "ratio_ours_to_default": median["ours"] / median["flower_default"],
        "repeats": args.repeats,
        "load_1min": loads,
    }
    for arm in fabs:
        print(
            f"{arm:15s} FAB {len(fabs[arm]) / 1e6:.2f} MB, re-install median "
            f"{median[arm] * 1e3:.0f} ms over {args.repeats}"
        )
    print(f"ours / Flower's default packing: {out['ratio_ours_to_default']:.2f}; load {loads}")
    if args.json:
        write_atomic(args.json, json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
