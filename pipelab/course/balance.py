"""How well a cut balances a pipeline: its slowest stage, the speed-up it allows, and two other cuts to compare.

With many micro-batches a pipeline moves one micro-batch per max_s (cost of stage s): the
slowest stage sets the pace, so a cut with stage costs C_s allows a speed-up over one device
of at most  sum_i c_i / max_s C_s <= p  (GPipe, Huang et al. 2019, §2.2; PipeDream,
Narayanan et al. 2019, §3.1, both balance their partitions for this reason).

`pipelab.model.partition.balanced_bounds` finds the cut with the lightest slowest stage; here are
the yardsticks a lesson holds it against: a greedy fill (the rule it beats) and brute force
over every contiguous cut (the reference it must equal).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from ..common.checks import check_counts


def stage_costs(costs: Sequence[float], bounds: Sequence[tuple[int, int]]) -> list[float]:
    """The cost of each stage: the sum of its blocks' costs (bounds are half-open block ranges)."""
    _check_bounds(bounds, len(costs))
    return [float(sum(costs[a:b])) for a, b in bounds]


def bottleneck(costs: Sequence[float], bounds: Sequence[tuple[int, int]]) -> float:
    """The slowest stage's cost, max_s C_s: what sets the pipeline's pace."""
    return max(stage_costs(costs, bounds))


def speedup_bound(costs: Sequence[float], bounds: Sequence[tuple[int, int]]) -> float:
    """sum_i c_i / max_s C_s: the most this cut can speed a step up over one device (no bubble)."""
    slowest = bottleneck(costs, bounds)
    return float(sum(costs)) / slowest if slowest > 0 else float(len(bounds))


def greedy_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Fill each stage until the next block would push it past the average, total / n_stages.

    The natural rule that is *not* optimal: on [1, 2, 3, 4, 5, 6] with 3 stages it cuts
    [(0, 3), (3, 4), (4, 6)], a slowest stage of 11 where 9 is possible.  Every stage gets at
    least one block, and enough blocks are left for the stages still to come.
    """
    costs = _check_costs(costs)
    check_counts(n_stages=n_stages)
    if n_stages > len(costs):
        raise ValueError(f"n_stages must be at most the number of blocks ({len(costs)}), got {n_stages}")
    average = sum(costs) / n_stages
    bounds, start = [], 0
    for stage in range(n_stages - 1):
        end, load = start + 1, costs[start]  # a stage holds at least one block
        last_allowed = len(costs) - (n_stages - 1 - stage)  # leave one block for each later stage
        while end < last_allowed and load + costs[end] <= average:
            load += costs[end]
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, len(costs)))
    return bounds


def every_cut(n_blocks: int, n_stages: int) -> Iterator[list[tuple[int, int]]]:
    """Every way to cut n_blocks into n_stages contiguous, non-empty stages: C(n_blocks - 1, n_stages - 1) of them."""
    for cuts in itertools.combinations(range(1, n_blocks), n_stages - 1):
        edges = (0, *cuts, n_blocks)
        yield list(zip(edges, edges[1:]))


def brute_force_bottleneck(costs: Sequence[float], n_stages: int) -> float:
    """The lightest slowest stage over every contiguous cut (slow: for checking, not for splitting)."""
    costs = _check_costs(costs)
    return min(bottleneck(costs, bounds) for bounds in every_cut(len(costs), n_stages))


def _check_costs(costs) -> list[float]:
    costs = [float(c) for c in costs]
    if not costs or not all(math.isfinite(c) and c >= 0 for c in costs):
        raise ValueError(f"costs must be a non-empty list of finite, non-negative numbers, got {costs}")
    return costs


def _check_bounds(bounds, n_blocks: int) -> None:
    edges = [a for a, _ in bounds] + [bounds[-1][1]] if bounds else []
    if (not bounds or edges[0] != 0 or edges[-1] != n_blocks
            or any(b <= a for a, b in bounds) or any(bounds[i][1] != bounds[i + 1][0] for i in range(len(bounds) - 1))):
        raise ValueError(f"bounds {list(bounds)} are not contiguous, non-empty stages covering blocks 0..{n_blocks - 1}")
