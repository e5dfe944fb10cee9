"""The FedSU headroom replay (experiments/headroom_sync.py): R alone vs FedSU's whole law."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

from headroom_sync import speculated_shares, stable_shares


def _tail_mean(series: list[float], n: int = 50) -> float:
    return sum(series[-n:]) / n


def test_the_law_keeps_lines_and_drops_random_walks_that_r_alone_calls_linear():
    g = torch.Generator().manual_seed(0)
    slope = torch.randn(1000, generator=g) * 0.01
    line = [slope * t + 1e-5 * torch.randn(1000, generator=g) for t in range(300)]
    walk = list(torch.cumsum(torch.randn(300, 1000, generator=g) * 0.01, 0))
    assert _tail_mean(speculated_shares(line)) > 0.9
    # R's EMA of second differences telescopes for any stationary update, so a random
    # walk passes R < T_R as often as a line does; the error checks send it back
    assert _tail_mean(stable_shares(walk)["fedsu"]) > 0.6
    assert _tail_mean(speculated_shares(walk)) < 0.15
