"""Mutant of Task 1.1: off by one in the dynamic programme's inner range.

``range(k - 1, j - 1)`` instead of ``range(k - 1, j)`` never tries a last stage of a
single layer, so a heavy last layer (an LM head) is never put on its own:
[1, 1, 1, 1, 4] on 2 stages gives [(0, 3), (3, 5)] (bottleneck 5), not [(0, 4), (4, 5)].
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    if n_stages < 1 or n_stages > len(costs) or any(cost < 0 for cost in costs):
        raise ValueError("bad arguments")
    n_layers = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    infinity = float("inf")
    best = [[infinity] * (n_layers + 1) for _ in range(n_stages + 1)]
    last_start = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n_layers + 1):
            for i in range(k - 1, max(k, j - 1)):  # BUG: misses i = j - 1 when it can
                bottleneck = max(best[k - 1][i], prefix[j] - prefix[i])
                if bottleneck < best[k][j]:
                    best[k][j] = bottleneck
                    last_start[k][j] = i
    bounds, end = [], n_layers
    for k in range(n_stages, 0, -1):
        start = last_start[k][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]
