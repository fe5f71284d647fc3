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
    # TODO: Implement for Task 1.1.
    raise NotImplementedError("Task 1.1")
