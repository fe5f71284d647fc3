"""Mutant of Task 1.1: greedy filling instead of the optimal split.

Fills each stage until the next layer would push it past sum(costs) / n_stages.  Always
a valid split, often not the best one: e.g. costs [3, 3, 2, 2] on 2 stages gives
[(0, 1), (1, 4)] (bottleneck 7) instead of [(0, 2), (2, 4)] (bottleneck 6).
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    if n_stages < 1 or n_stages > len(costs) or any(cost < 0 for cost in costs):
        raise ValueError("bad arguments")
    target = sum(costs) / n_stages
    bounds, start, stage_cost = [], 0, 0.0
    for i, cost in enumerate(costs):
        stages_after_this = n_stages - len(bounds) - 1
        too_full = stage_cost + cost > target
        must_close = len(costs) - i == stages_after_this  # one layer left per stage
        if i > start and stages_after_this > 0 and (too_full or must_close):
            bounds.append((start, i))
            start, stage_cost = i, 0.0
        stage_cost += cost
    bounds.append((start, len(costs)))
    return bounds
