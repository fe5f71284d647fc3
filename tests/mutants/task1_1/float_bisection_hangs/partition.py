"""Mutant of Task 1.1: bisection on the bottleneck that never ends (an infinite loop).

``while lo < hi`` with float midpoints: once lo and hi are neighbouring floats the
midpoint rounds to one of them and nothing changes any more.  The graders must stop it
with a timeout and say so.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    if n_stages < 1 or n_stages > len(costs) or any(cost < 0 for cost in costs):
        raise ValueError("bad arguments")
    lo, hi = float(max(costs)), float(sum(costs))
    while lo < hi:  # BUG: needs a tolerance, or integer costs
        mid = (lo + hi) / 2
        if _fits(costs, n_stages, mid):
            hi = mid
        else:
            lo = mid
    return _cut(costs, hi)


def _fits(costs: Sequence[float], n_stages: int, limit: float) -> bool:
    return len(_cut(costs, limit)) <= n_stages


def _cut(costs: Sequence[float], limit: float) -> list[tuple[int, int]]:
    bounds, start, stage_cost = [], 0, 0.0
    for i, cost in enumerate(costs):
        if i > start and stage_cost + cost > limit:
            bounds.append((start, i))
            start, stage_cost = i, 0.0
        stage_cost += cost
    bounds.append((start, len(costs)))
    return bounds
