"""Gradient consistency and the stall detector against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from fl.mechanisms.diagnosis import ConsistencyEMA, PlateauDetector, consistency, consistency_ratio


def test_consistency_of_one_round_by_hand():
    updates = torch.tensor([[1.0, 1.0, 0.0, 3.0], [1.0, -1.0, 0.0, -1.0]])
    # agree: 1; cancel: 0; never moved: 0 (no NaN); |3 - 1| / (3 + 1) = 0.5
    assert consistency(updates).tolist() == [1.0, 0.0, 0.0, 0.5]
    assert consistency_ratio(torch.tensor([2.0]), torch.tensor([-1.0])).item() == pytest.approx(
        1 / 3
    )


def test_bilateral_ema_by_hand_and_reset():
    ema = ConsistencyEMA.zeros(2, theta=0.5)
    first = ema.update(torch.tensor([[1.0, 2.0], [1.0, -2.0]]))
    assert first.tolist() == [1.0, 0.0]  # the first round's R is that round's raw R
    # P = .5*1 + .5*0 = .5 (x0) ; N = .5*0 - .5*2 = -1: R = .5 / 1.5
    second = ema.update(torch.tensor([[0.0, 0.0], [-2.0, 0.0]]))
    assert second[0].item() == pytest.approx(0.5 / 1.5)
    ema.reset(torch.tensor([True, False]))
    assert ema.positive[0] == 0 and ema.negative[0] == 0 and ema.negative[1] != 0


def test_bilateral_pooling_equals_gift_ema_of_sum_over_ema_of_abs():
    gen = torch.Generator().manual_seed(0)
    ema, theta = ConsistencyEMA.zeros(50, theta=0.9), 0.9
    signed, magnitude = torch.zeros(50), torch.zeros(50)
    for _ in range(7):
        updates = torch.randn(5, 50, generator=gen)
        rate = ema.update(updates)
        signed = theta * signed + (1 - theta) * updates.sum(0)
        magnitude = theta * magnitude + (1 - theta) * updates.abs().sum(0)
    assert torch.allclose(rate, signed.abs() / magnitude, atol=1e-6)


def _stalls(detector: PlateauDetector, series: list[float]) -> list[int]:
    """Rounds (1-based) at which the single series stalled."""
    return [
        r
        for r, value in enumerate(series, start=1)
        if bool(detector.step(torch.tensor([value]), r)[0])
    ]


def test_falling_then_flat_series_stalls_once_window_rounds_after_its_low():
    detector = PlateauDetector.fresh(1, window=5)
    series = [0.9, 0.8, 0.7, 0.6] + [0.6] * 6  # low reached at round 4
    assert _stalls(detector, series) == [10]  # 10 - 4 > 5, first time at round 10
    assert detector.window.tolist() == [10] and math.isinf(detector.low.item())


def test_window_doubles_after_each_stall():
    detector = PlateauDetector.fresh(1, window=2)
    # low at 1, stall at 4 (3 > 2); the next value is a new low (5), stall at 10 (5 > 4); ...
    assert _stalls(detector, [0.5] * 20) == [4, 10, 20]
    assert detector.window.tolist() == [16]


def test_warmup_eligibility_and_one_step_mode():
    detector = PlateauDetector.fresh(1, window=1, warmup=5)
    assert _stalls(detector, [0.5] * 7) == [6]  # due at round 3, held back until round 6
    held = PlateauDetector.fresh(2, window=1)
    for r in range(1, 5):
        stalled = held.step(torch.tensor([0.5, 0.5]), r, eligible=torch.tensor([True, False]))
    assert stalled.tolist() == [False, False] and held.window.tolist() == [2, 1]
    # window 0, growth 1: a stall whenever the value did not fall since the last round
    one_step = PlateauDetector.fresh(1, window=0, growth=1)
    assert _stalls(one_step, [0.9, 0.8, 0.85, 0.7, 0.6, 0.6, 0.5]) == [3, 6]
