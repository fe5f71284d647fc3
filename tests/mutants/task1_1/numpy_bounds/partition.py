"""Mutant of Task 1.1: the right split, with boundaries that are numpy integers.

Prefix sums with ``np.cumsum`` and each cut found with ``np.argmin`` give the optimal
stages, but as ``(np.int64(0), np.int64(2))``: equal to ``(0, 2)`` under ==, yet not the
``int`` the docstring promises (``range(start, end)`` works, ``json.dumps`` does not).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    if n_stages < 1 or n_stages > len(costs) or any(cost < 0 for cost in costs):
        raise ValueError("bad arguments")
    n_layers = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    best = np.full((n_stages + 1, n_layers + 1), np.inf)
    last_start = np.zeros((n_stages + 1, n_layers + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n_layers + 1):
            starts = np.arange(k - 1, j)
            candidates = np.maximum(best[k - 1, starts], prefix[j] - prefix[starts])
            last_start[k, j] = starts[np.argmin(candidates)]
            best[k, j] = candidates.min()
    bounds, end = [], np.int64(n_layers)
    for k in range(n_stages, 0, -1):
        start = last_start[k, end]
        bounds.append((start, end))  # BUG: numpy integers, not int
        end = start
    return bounds[::-1]
