"""pipelab.course.balance: stage costs, the greedy fill, brute force, and balanced_bounds held against brute force."""

import math
import random

import pytest

from pipelab.course.balance import (bottleneck, brute_force_bottleneck, every_cut, greedy_bounds, speedup_bound,
                             stage_costs)
from pipelab.model.partition import balanced_bounds


def test_stage_costs_and_bottleneck():
    costs = [1, 2, 3, 4, 5, 6]
    assert stage_costs(costs, [(0, 3), (3, 4), (4, 6)]) == [6.0, 4.0, 11.0]
    assert bottleneck(costs, [(0, 3), (3, 4), (4, 6)]) == 11.0
    assert speedup_bound(costs, [(0, 4), (4, 5), (5, 6)]) == pytest.approx(21 / 10)
    assert speedup_bound([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3), (3, 4)]) == 4.0  # balanced: p


@pytest.mark.parametrize("bounds", [[(0, 2), (3, 6)], [(0, 3), (3, 3), (3, 6)], [(1, 6)], [(0, 5)], []])
def test_bounds_must_cover_the_blocks(bounds):
    with pytest.raises(ValueError, match="not contiguous"):
        stage_costs([1, 2, 3, 4, 5, 6], bounds)


def test_greedy_fill_of_the_lesson():
    assert greedy_bounds([1, 2, 3, 4, 5, 6], 3) == [(0, 3), (3, 4), (4, 6)]
    assert greedy_bounds([5, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # leaves a block per later stage
    assert greedy_bounds([1, 1, 1, 9], 2) == [(0, 3), (3, 4)]
    with pytest.raises(ValueError, match="n_stages"):
        greedy_bounds([1, 2], 3)


def test_every_cut_counts_the_combinations():
    assert len(list(every_cut(8, 4))) == math.comb(7, 3)
    assert list(every_cut(3, 3)) == [[(0, 1), (1, 2), (2, 3)]]


def test_balanced_bounds_equals_brute_force_and_never_loses_to_greedy():
    rng = random.Random(0)
    for _ in range(200):
        n_blocks = rng.randint(1, 9)
        costs = [rng.choice([0, 1, 2, 3, 5, 8, 13]) * rng.random() for _ in range(n_blocks)]
        n_stages = rng.randint(1, n_blocks)
        best = brute_force_bottleneck(costs, n_stages)
        assert bottleneck(costs, balanced_bounds(costs, n_stages)) == pytest.approx(best)
        assert bottleneck(costs, greedy_bounds(costs, n_stages)) >= best - 1e-12
    assert brute_force_bottleneck([1, 2, 3, 4, 5, 6], 3) == 9.0
