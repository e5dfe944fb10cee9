"""Keep a finished sweep's readable outputs in the repository, so its table can be
regenerated on a fresh clone (issue 35: long room runs outlive the machine they ran on).

For each sweep folder given, into `--to/<the folder's name>`: its `sweep.json` and, for each
finished job (`fl.run.compare.find_runs`), the files `fl.run.compare.load_run` reads:
`.hydra/overrides.yaml`, `summary.json`, and `metrics.jsonl` gzip-compressed
(`metrics.jsonl.gz`, which `load_run` reads where no `metrics.jsonl` is), plus `config.yaml`
for the reader. Checkpoints and logs stay behind. Archiving the same run again writes the
same bytes; files are read only if regular UTF-8 text within the text limit
(`fl.common.files.read_regular_text`) and written never through a link.

    python experiments/archive_runs.py experiments/out/fedca_room/2026-12-07_fedavg_s0 \
        --to experiments/records/sweeps/fedca_room
    python experiments/room_table.py experiments/records/sweeps/fedca_room/* ...
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl.common.files import make_dir, read_regular_text, write_atomic
from fl.run.compare import ARCHIVED_METRICS, find_runs

KEPT = (".hydra/overrides.yaml", "summary.json", "config.yaml")  # copied as they are


def archive(sweep: Path, into: Path) -> list[Path]:
    """`sweep`'s finished jobs kept under `into`; the job folders written."""
    jobs = find_runs(sweep)
    if not jobs or jobs == [sweep]:
        raise SystemExit(f"{sweep} holds no finished job of a sweep")
    make_dir(into)
    if (sweep / "sweep.json").exists():
        write_atomic(into / "sweep.json", read_regular_text(sweep / "sweep.json"))
    written = []
    for job in jobs:
        target = make_dir(into / job.name)
        make_dir(target / ".hydra")
        for name in KEPT:
            write_atomic(target / name, read_regular_text(job / name))
        metrics = read_regular_text(job / "metrics.jsonl").encode()
        metrics = gzip.compress(metrics, compresslevel=9, mtime=0)
        write_atomic(target / ARCHIVED_METRICS, metrics)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep folders (hydra.sweep.dir)")
    parser.add_argument("--to", type=Path, required=True, help="the archive's parent folder")
    args = parser.parse_args(argv)
    for sweep in args.sweeps:
        for job in archive(sweep, args.to / sweep.resolve().name):
            print(job)


if __name__ == "__main__":
    main()
