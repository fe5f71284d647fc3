"""Task 1.1: split a model's layers into pipeline stages of balanced cost (lesson 01)."""

from __future__ import annotations

from collections.abc import Sequence


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Split layers ``0 .. len(costs)`` into ``n_stages`` contiguous stages whose slowest
    stage is as fast as possible.

    A pipeline runs at the pace of its slowest stage.  With ``c_i = costs[i]`` (the time,
    FLOPs or bytes of layer i), p = ``n_stages`` and n = ``len(costs)``, choose boundaries
    ``0 = b_0 < b_1 < ... < b_p = n`` that minimise the bottleneck

        max_s  sum_{b_s <= i < b_{s+1}}  c_i

    Stage s holds layers ``b_s .. b_{s+1} - 1`` and is returned as the half-open pair
    ``(b_s, b_{s+1})``; every stage gets at least one layer, even a layer of cost 0.
    Returns a new list of ``n_stages`` tuples of two ``int``.  When several splits reach
    the same bottleneck, any one of them is a correct answer: 8 equal layers on 3 stages
    may be split 3, 3, 2 or 3, 2, 3 or 2, 3, 3 layers, not 2, 2, 4.  ``costs`` may be a
    list or a tuple, of ints or floats of any size (seconds, or FLOPs and bytes near
    1e12); it is left unchanged.

    Filling each stage up to ``sum(costs) / n_stages`` (greedy) is *not* optimal.  Hint:
    dynamic programming over "the first j layers on k stages", O(p n^2), or a search over
    the bottleneck value.

    The source text's case, 8 layers of equal cost on 4 devices:

    >>> balanced_bounds([1.0] * 8, 4)
    [(0, 2), (2, 4), (4, 6), (6, 8)]
    >>> balanced_bounds([1, 1, 1, 1, 4], 2)
    [(0, 4), (4, 5)]

    Raises:
        ValueError: if ``n_stages < 1``; if ``n_stages > len(costs)`` (a stage would be
            empty); if a cost is negative.
    """
    _check_arguments(costs, n_stages)
    n_layers = len(costs)

    # prefix[j] = c_0 + ... + c_{j-1}, so layers i .. j-1 cost prefix[j] - prefix[i].
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    # best[k][j]: the smallest bottleneck for layers 0 .. j-1 on k stages.
    # last_start[k][j]: where the last of those k stages starts in that best split.
    infinity = float("inf")
    best = [[infinity] * (n_layers + 1) for _ in range(n_stages + 1)]
    last_start = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n_layers + 1):
            for i in range(k - 1, j):  # the k-th stage is layers i .. j-1 (non-empty)
                bottleneck = max(best[k - 1][i], prefix[j] - prefix[i])
                if bottleneck < best[k][j]:
                    best[k][j] = bottleneck
                    last_start[k][j] = i

    # Walk back from the last stage to the first.
    bounds = []
    end = n_layers
    for k in range(n_stages, 0, -1):
        start = last_start[k][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def _check_arguments(costs: Sequence[float], n_stages: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages must be at least 1, got {n_stages}")
    if n_stages > len(costs):
        raise ValueError(
            f"cannot split {len(costs)} layers into {n_stages} non-empty stages; "
            f"use at most {len(costs)} stages"
        )
    for index, cost in enumerate(costs):
        if cost < 0:
            raise ValueError(f"costs[{index}] = {cost} is negative; a layer's cost is >= 0")
