"""The suite's own helpers: per_world_size.PerWorldSize."""

import traceback

import pytest

from per_world_size import PerWorldSize


def test_a_world_size_is_launched_once_when_first_asked_for():
    made = []
    ranks = PerWorldSize(lambda n: made.append(n) or [n] * n, (1, 2, 3))
    assert made == [] and list(ranks) == [1, 2, 3] and len(ranks) == 3
    assert ranks[2] == [2, 2] and ranks[2] == [2, 2] and made == [2]
    with pytest.raises(KeyError):
        ranks[4]


def test_a_failed_launch_fails_every_test_that_asks_without_running_again_or_growing_its_traceback():
    made = []

    def make(n):
        made.append(n)
        raise RuntimeError(f"rank 0 failed at N = {n}")

    ranks = PerWorldSize(make, (1, 2))
    depths = []
    for _ in range(20):  # twenty tests, each asking for N = 2
        with pytest.raises(RuntimeError, match="N = 2") as info:
            ranks[2]
        depths.append(len(traceback.extract_tb(info.value.__traceback__)))
    assert made == [2]
    assert depths[-1] == depths[0], depths  # raised from its first traceback each time, not a longer one
