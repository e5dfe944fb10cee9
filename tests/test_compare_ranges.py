"""Comparisons from few seeds: intervals kept inside each figure's range, a warning under 3
seeds, and differences printed with the digits they need (or "identical")."""

from __future__ import annotations

import logging

import matplotlib.axes
import pytest
from test_compare import _job

from fl.run.compare import compare_runs, find_runs
from fl.run.intervals import ACCURACY, NON_NEGATIVE, few_seeds_warning, interval


def _sweep(path, accuracies: dict[str, list[float]]) -> list:
    num = 0
    for strategy, values in accuracies.items():
        for seed, accuracy in enumerate(values):
            _job(path / str(num), [f"strategy={strategy}", f"seed={seed}"], accuracy)
            num += 1
    return find_runs(path)


def test_intervals_are_clipped_to_the_figures_range():
    assert interval([0.95, 0.99], bounds=ACCURACY)[2] == 1.0
    assert interval([0.95, 0.99])[2] > 1.0  # unclipped, the t-interval passes 1
    assert interval([0.1, 5.0], bounds=NON_NEGATIVE)[1] == 0.0
    assert interval([0.4, 0.5, 0.6], bounds=ACCURACY) == pytest.approx(
        interval([0.4, 0.5, 0.6])
    )  # inside the range: untouched


def test_two_seeds_warn_in_the_table_and_the_log(tmp_path, caplog):
    runs = _sweep(tmp_path, {"fedavg": [0.95, 0.99], "apf": [0.9, 0.97]})
    with caplog.at_level(logging.WARNING, logger="fl.run.compare"):
        table = compare_runs(runs, tmp_path, "t", plots=False)
    assert "**Warning:** only 2 seeds per arm" in table and "seed=0,1,2" in table
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "only 2 seeds per arm" in caplog.records[0].getMessage()
    assert "| strategy=fedavg | 2 | 0.9700 [0.7159, 1.0000] |" in table  # not 1.2241


def test_three_seeds_do_not_warn(tmp_path, caplog):
    runs = _sweep(tmp_path, {"fedavg": [0.9, 0.91, 0.92], "apf": [0.9, 0.9, 0.93]})
    with caplog.at_level(logging.WARNING, logger="fl.run.compare"):
        table = compare_runs(runs, tmp_path, "t", plots=False)
    assert "Warning" not in table and not caplog.records
    assert few_seeds_warning(3) is None and "no interval" in str(few_seeds_warning(1))


def test_identical_arms_say_so_and_tiny_differences_keep_their_digits(tmp_path):
    base = [0.9, 0.91, 0.92]
    runs = _sweep(
        tmp_path,
        {
            "fedavg": base,
            "fedprox": list(base),  # the same on every seed: mu too small to matter
            "apf": [a + d for a, d in zip(base, (1e-5, 2e-5, 3e-5), strict=True)],
        },
    )
    table = compare_runs(runs, tmp_path, "t", plots=False)
    paired = table.split("Paired with")[1]
    assert "| strategy=fedprox | 3 | identical (all 3 seeds) | identical (all 3 seeds) | - |" in (
        paired  # no target set: no time to it ("-"), not "not reached"
    )
    # Δ 2e-5 ± 4.303 · 1e-5 / √3 = ± 2.5e-5: decimals for two significant digits of the
    # interval's width, not 0.0000 [-0.0000, 0.0000]
    assert "| strategy=apf | 3 | 0.000020 [-0.000005, 0.000045] |" in paired


def test_the_plot_band_stays_inside_accuracys_range(tmp_path, monkeypatch):
    bands: list[list[float]] = []
    original = matplotlib.axes.Axes.fill_between

    def spy(self, x, low, high, **kwargs):
        bands.append([*low, *high])
        return original(self, x, low, high, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", spy)
    runs = _sweep(tmp_path, {"fedavg": [0.95, 0.99], "apf": [0.9, 0.97]})
    compare_runs(runs, tmp_path, "t")
    assert bands and all(0.0 <= y <= 1.0 for band in bands for y in band)
    assert max(max(band) for band in bands) == 1.0  # the unclipped band passes 1
