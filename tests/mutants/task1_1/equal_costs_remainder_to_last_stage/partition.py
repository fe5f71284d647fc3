"""Mutant of Task 1.1: a shortcut for equal costs that puts the remainder on the last stage.

When every layer costs the same, n // p layers per stage and the n % p left over on the
last stage.  Right when p divides n or leaves one layer over ([1.0] * 8 on 4 stages, or
7 on 3), wrong from a remainder of 2: 8 equal layers on 3 stages give 2, 2, 4 layers
(bottleneck 4) instead of 3, 3, 2 (bottleneck 3).  Unequal costs go to a correct
dynamic programme.
"""

from __future__ import annotations

from collections.abc import Sequence

from solutions.partition import balanced_bounds as _optimal


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    if n_stages < 1 or n_stages > len(costs) or any(cost < 0 for cost in costs):
        raise ValueError("bad arguments")
    if len(set(costs)) > 1:
        return _optimal(costs, n_stages)
    per_stage = len(costs) // n_stages
    edges = [stage * per_stage for stage in range(n_stages)] + [len(costs)]  # BUG: remainder at the end
    return list(zip(edges[:-1], edges[1:]))
