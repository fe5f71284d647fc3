"""Mutant of Task 1.1: bisection on the bottleneck with an absolute tolerance, ``hi - lo > 1e-9``.

Right on every test whose costs are small numbers (seconds, layer counts): it stops
once the bottleneck is known to 1e-9, then cuts exactly n_stages stages under that
limit.  Costs in FLOPs or bytes (1e12) never get there: two neighbouring floats near
1e12 are 1.2e-4 apart, so ``hi - lo`` stays above 1e-9 and the loop never ends.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    if n_stages < 1 or n_stages > len(costs) or any(cost < 0 for cost in costs):
        raise ValueError("bad arguments")
    lo, hi = float(max(costs)), float(sum(costs))
    while hi - lo > 1e-9:  # BUG: an absolute tolerance; floats near 1e12 are further apart than that
        mid = (lo + hi) / 2
        if _fits(costs, n_stages, mid):
            hi = mid
        else:
            lo = mid
    return _cut(costs, n_stages, hi)


def _fits(costs: Sequence[float], n_stages: int, limit: float) -> bool:
    stages, stage_cost = 1, 0.0
    for cost in costs:
        if stage_cost + cost > limit:
            stages, stage_cost = stages + 1, 0.0
        stage_cost += cost
    return stages <= n_stages


def _cut(costs: Sequence[float], n_stages: int, limit: float) -> list[tuple[int, int]]:
    """Exactly n_stages stages, none over limit: close a stage when the next layer would
    pass the limit, or when the layers left are as many as the stages left."""
    bounds, start, stage_cost = [], 0, 0.0
    for i, cost in enumerate(costs):
        stages_left = n_stages - len(bounds) - 1
        if i > start and stages_left > 0 and (stage_cost + cost > limit or len(costs) - i == stages_left):
            bounds.append((start, i))
            start, stage_cost = i, 0.0
        stage_cost += cost
    bounds.append((start, len(costs)))
    return bounds
