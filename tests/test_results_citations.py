"""Each scoreboard record's `where` names one section of experiments/RESULTS.md by its heading path,
so a reader of docs/REPRODUCTIONS.md lands on the run the verdict comes from."""

from __future__ import annotations

import re

from experiments.scoreboard import ROOT, load_records

RESULTS = ROOT / "experiments" / "RESULTS.md"
PREFIX = "experiments/RESULTS.md § "


def headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of every Markdown heading outside code fences, in order."""
    found, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        match = None if fence else re.match(r"^(#{1,6}) (.+?)\s*$", line)
        if match:
            found.append((len(match.group(1)), match.group(2)))
    return found


def resolve(path: list[str], heads: list[tuple[int, str]]) -> int:
    """How many heading chains match `path`: each name a heading nested under the one before."""

    def count(start: int, end: int, level: int, names: list[str]) -> int:
        total = 0
        for i in range(start, end):
            lvl, text = heads[i]
            if lvl <= level:
                break
            if text != names[0]:
                continue
            if len(names) == 1:
                total += 1
                continue
            stop = next((j for j in range(i + 1, len(heads)) if heads[j][0] <= lvl), len(heads))
            total += count(i + 1, stop, lvl, names[1:])
        return total

    return sum(count(i, i + 1, 0, path) for i in range(len(heads)) if heads[i][1] == path[0])


def test_every_record_cites_exactly_one_results_section():
    heads = headings(RESULTS.read_text())
    for record in load_records():
        where = record["source"]["where"]
        if not where.startswith(PREFIX):
            continue  # a sweep recorded by --record names its directory, not a section
        path = where.removeprefix(PREFIX).split(" › ")
        assert resolve(path, heads) == 1, f"{record['system']}: {where!r} is not one section"


def test_the_resolver_rejects_a_wrong_parent():
    heads = [(2, "A"), (3, "Rerun"), (2, "B"), (3, "Rerun"), (3, "Other")]
    assert resolve(["A", "Rerun"], heads) == 1
    assert resolve(["B", "Other"], heads) == 1
    assert resolve(["A", "Other"], heads) == 0
    assert resolve(["Rerun"], heads) == 2
