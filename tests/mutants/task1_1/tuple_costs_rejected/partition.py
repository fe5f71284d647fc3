"""Mutant of Task 1.1: prefix sums built with ``[0] + costs``, which only works for a list.

The docstring promises any sequence of costs: a tuple of costs raises
``TypeError: can only concatenate list (not "tuple") to list``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    if n_stages < 1 or n_stages > len(costs) or any(cost < 0 for cost in costs):
        raise ValueError("bad arguments")
    n_layers = len(costs)
    prefix = list(itertools.accumulate([0] + costs))  # BUG: a tuple cannot be added to a list
    infinity = float("inf")
    best = [[infinity] * (n_layers + 1) for _ in range(n_stages + 1)]
    last_start = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n_layers + 1):
            for i in range(k - 1, j):
                bottleneck = max(best[k - 1][i], prefix[j] - prefix[i])
                if bottleneck < best[k][j]:
                    best[k][j] = bottleneck
                    last_start[k][j] = i
    bounds, end = [], n_layers
    for k in range(n_stages, 0, -1):
        bounds.append((last_start[k][end], end))
        end = last_start[k][end]
    return bounds[::-1]
