"""Mutant of Task 1.1: recursive halving, right on most draws but not optimal.

Gives half the stages to a left part and the rest to a right part, cutting where the
two parts' cost per stage is closest, and recurses.  That is the best split on most
random costs (about 24 draws in 25), not on all: [3, 18, 10, 7] on 3 stages is cut
[3, 18] | [10, 7] (averages 21 and 8.5 are the closest), so one stage costs 21 where
[(0, 1), (1, 2), (2, 4)] has a slowest stage of 18.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    if n_stages < 1 or n_stages > len(costs) or any(cost < 0 for cost in costs):
        raise ValueError("bad arguments")
    return _split(list(costs), 0, len(costs), n_stages)


def _split(costs: list, lo: int, hi: int, n_stages: int) -> list[tuple[int, int]]:
    if n_stages == 1:
        return [(lo, hi)]
    left = n_stages // 2
    right = n_stages - left
    # BUG: balances the average cost per stage of the two halves, not the bottleneck
    cut = min(
        range(lo + left, hi - right + 1),
        key=lambda c: abs(sum(costs[lo:c]) / left - sum(costs[c:hi]) / right),
    )
    return _split(costs, lo, cut, left) + _split(costs, cut, hi, right)
