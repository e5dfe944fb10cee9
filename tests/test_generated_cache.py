"""Generated clients are kept once made where the population fits the bound, never beyond."""

from __future__ import annotations

import torch

from fl.common.config import compose
from fl.world.task import GENERATED_CACHE_BYTES, get_task

TASK = ["task=synthetic", "partition=natural", "task.options.dim=8", "task.hidden=[8]"]


def test_a_small_population_is_generated_once_and_a_large_one_per_use():
    small = get_task(compose([*TASK, "num_clients=50", "seed=11"]))
    first = small.client_data(7)
    again = small.client_data(7)
    assert all(a is b for a, b in zip(first, again, strict=True))  # kept, not drawn again
    assert small.devices is not None
    for kept, drawn in zip(again, small.devices.train(7), strict=True):
        assert torch.equal(kept, drawn)  # the very data a fresh draw gives
    # a million clients' data (about 8 + 4·dim bytes a sample) is over the bound: per use
    huge = get_task(compose([*TASK, "num_clients=1000000", "seed=11"]))
    assert huge.devices is not None
    assert int(huge.devices.train_sizes.sum()) * (8 + 4 * 8) > GENERATED_CACHE_BYTES
    one, two = huge.client_data(7), huge.client_data(7)
    assert all(a is not b and torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(one, first, strict=True))  # same client 7
