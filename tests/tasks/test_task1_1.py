"""Task 1.1: balanced_bounds, the optimal split of layer costs into pipeline stages.

The reference is brute force: try every way to place the n_stages - 1 cuts.  The
boundaries of the docstring are drawn on purpose (``@example``, and strategies that reach
them): one stage, one layer per stage, layers of cost 0, equal costs that leave a
remainder of 2 or more, int and float costs, a list and a tuple.  Every answer is checked
for its type (a list of tuples of int) and for leaving ``costs`` unchanged.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contract import assert_type, assert_unchanged, picture

pytestmark = pytest.mark.task1_1

OPTIMAL = "balanced_bounds returns a split whose slowest stage is as fast as possible"
VALID = "balanced_bounds returns n_stages contiguous, non-empty (start, end) stages covering every layer"


def bottleneck(costs, bounds) -> float:
    """The cost of the slowest stage: max_s sum_{start_s <= i < end_s} c_i."""
    return max(sum(costs[start:end]) for start, end in bounds)


def best_bottleneck(costs, n_stages) -> tuple[float, list[tuple[int, int]]]:
    """Brute force over all C(n - 1, n_stages - 1) placements of the cuts."""
    return best_bottlenecks(costs)[n_stages]


def best_bottlenecks(costs) -> dict[int, tuple[float, list[tuple[int, int]]]]:
    """n_stages -> (the smallest bottleneck, a split reaching it), for every n_stages at
    once: brute force over all 2^(n - 1) sets of cuts."""
    n_layers = len(costs)
    best = {}
    for n_cuts in range(n_layers):
        for cuts in itertools.combinations(range(1, n_layers), n_cuts):
            edges = (0, *cuts, n_layers)
            bounds = list(zip(edges[:-1], edges[1:]))
            best[n_cuts + 1] = min(best.get(n_cuts + 1, (float("inf"), [])), (bottleneck(costs, bounds), bounds))
    return best


def assert_valid_partition(bounds, n_layers, n_stages, call):
    types = "balanced_bounds returns a list of (start, end) tuples of int"
    assert_type(bounds, list, types, f"{call}'s result")
    assert len(bounds) == n_stages, f"{VALID}\n{call} returned {len(bounds)} stages: {bounds}"
    ends = [0]
    for stage, bound in enumerate(bounds):
        assert_type(bound, tuple, types, f"{call} returned {bounds}; stage {stage}")
        assert len(bound) == 2, f"{types}\n{call}: stage {stage} is {bound!r}"
        for name, number in zip(("start", "end"), bound):
            assert_type(number, int, types, f"{call} returned {bounds}; stage {stage}'s {name}")
        start, end = bound
        assert start == ends[-1], (
            f"{VALID}\n{call} returned {bounds}: stage {stage} starts at {start}, but the "
            f"previous stage ends at {ends[-1]} (bounds are half-open: (start, end) holds "
            "start..end-1)"
        )
        assert end > start, f"{VALID}\n{call} returned {bounds}: stage {stage} is empty"
        ends.append(end)
    assert ends[-1] == n_layers, f"{VALID}\n{call} returned {bounds}, which does not end at {n_layers}"


def assert_optimal(balanced_bounds, costs, n_stages, best=None):
    """``best``: best_bottleneck(costs, n_stages), if it is known already."""
    call = f"balanced_bounds({costs!r}, {n_stages})"
    before = picture(costs)
    bounds = balanced_bounds(costs, n_stages)
    assert_unchanged(before, costs, "costs", call)
    assert_valid_partition(bounds, len(costs), n_stages, call)
    best, best_bounds = best or best_bottleneck(costs, n_stages)
    assert bottleneck(costs, bounds) == pytest.approx(best), (
        f"{OPTIMAL}\n{call} returned {bounds}, whose slowest stage costs "
        f"{bottleneck(costs, bounds)}; {best_bounds} does better, with a slowest stage of {best}"
    )


def test_source_example_eight_equal_layers_on_four_devices(impl):
    bounds = impl("partition").balanced_bounds([1.0] * 8, 4)
    assert bounds == [(0, 2), (2, 4), (4, 6), (6, 8)], (
        f"{OPTIMAL}\nbalanced_bounds([1.0] * 8, 4) returned {bounds}, expected two layers per stage"
    )
    assert_optimal(impl("partition").balanced_bounds, [1.0] * 8, 4)


def test_heavy_last_layer_gets_a_stage_of_its_own(impl):
    # Equal layer counts would give [(0, 2), (2, 5)]: bottleneck 6 instead of 4.
    bounds = impl("partition").balanced_bounds([1, 1, 1, 1, 4], 2)
    assert bounds == [(0, 4), (4, 5)], f"{OPTIMAL}\nbalanced_bounds([1, 1, 1, 1, 4], 2) returned {bounds}"
    assert_optimal(impl("partition").balanced_bounds, [1, 1, 1, 1, 4], 2)


def test_filling_stages_greedily_is_not_enough(impl):
    # Filling up to sum / n_stages = 5 gives [(0, 1), (1, 4)]: bottleneck 7 instead of 6.
    assert_optimal(impl("partition").balanced_bounds, [3, 3, 2, 2], 2)


def test_one_stage_and_one_layer_per_stage(impl):
    assert_optimal(impl("partition").balanced_bounds, [2.0, 5.0, 1.0], 1)
    assert_optimal(impl("partition").balanced_bounds, [2.0, 5.0, 1.0], 3)
    assert_optimal(impl("partition").balanced_bounds, [7], 1)


@pytest.mark.parametrize(
    ("n_layers", "n_stages"), [(8, 3), (7, 5), (11, 4), (12, 5)], ids=lambda n: str(n)
)
def test_equal_costs_with_a_remainder_of_two_or_more(impl, n_layers, n_stages):
    # n % p >= 2 layers left over: they go to different stages (8 on 3: 3, 3, 2 layers).
    assert_optimal(impl("partition").balanced_bounds, [1.5] * n_layers, n_stages)


def test_layers_of_cost_zero_still_get_a_stage_each(impl):
    assert_optimal(impl("partition").balanced_bounds, [0, 0, 0], 3)
    assert_optimal(impl("partition").balanced_bounds, [0.0, 5.0, 0.0, 0.0], 3)


def test_costs_of_any_size_flops_and_bytes(impl):
    # Near 1e12 two neighbouring floats are 1.2e-4 apart: a search that waits for an
    # absolute gap of 1e-9 never ends.
    assert_optimal(impl("partition").balanced_bounds, [2.5e12, 1e12, 3e12, 1e12, 4e12], 3)
    assert_optimal(impl("partition").balanced_bounds, [3 * 2**30, 2**30, 5 * 2**30, 2**29], 2)


def test_costs_as_a_tuple_and_left_unchanged(impl):
    balanced_bounds = impl("partition").balanced_bounds
    costs = [3, 1.5, 0, 2, 2, 4]
    assert_optimal(balanced_bounds, costs, 3)
    assert_optimal(balanced_bounds, tuple(costs), 3)


def test_the_average_balanced_split_is_not_always_optimal(impl):
    # Halving the stages where the two halves' average cost per stage is closest gives
    # [3, 18] | [10, 7] (one stage and two): bottleneck 21, where 18 is possible.
    assert_optimal(impl("partition").balanced_bounds, [3, 18, 10, 7], 3)


@pytest.mark.parametrize(
    ("costs", "n_stages", "why"),
    [
        ([1.0, 2.0], 0, "n_stages < 1"),
        ([1.0, 2.0], -1, "n_stages < 1"),
        ([1.0, 2.0], 3, "n_stages > len(costs): a stage would be empty"),
        ([], 1, "n_stages > len(costs): a stage would be empty"),
        ([1.0, -2.0, 3.0], 2, "a cost is negative"),
        ((1, 2, -0.5), 1, "a cost is negative"),
    ],
    ids=["zero_stages", "negative_stages", "more_stages_than_layers", "no_layers",
         "negative_cost", "negative_cost_in_a_tuple"],
)
def test_invalid_arguments_raise_value_error(impl, costs, n_stages, why):
    with pytest.raises(ValueError):
        impl("partition").balanced_bounds(costs, n_stages)
        pytest.fail(f"balanced_bounds raises ValueError if {why}\n"
                    f"balanced_bounds({costs!r}, {n_stages}) returned without raising")


layer_cost = st.integers(0, 20) | st.floats(0, 20, allow_nan=False, allow_infinity=False)
n_layers = st.integers(1, 9)  # drawn first, so that every length is tried in every run
layer_costs = st.one_of(
    n_layers.flatmap(lambda n: st.lists(layer_cost, min_size=n, max_size=n)),
    st.builds(lambda cost, n: [cost] * n, layer_cost, n_layers),  # equal costs
    n_layers.flatmap(lambda n: st.lists(st.sampled_from([0, 0, 1, 5]), min_size=n, max_size=n)),  # zeros, ties
)
scale = st.sampled_from([1, 1, 10**6, 10**12])  # seconds, or FLOPs and bytes
layer_costs = st.builds(lambda costs, factor: [cost * factor for cost in costs], layer_costs, scale)


@settings(max_examples=150, deadline=None)
@example([1] * 8)  # equal costs: a remainder of 2 on 3 stages
@example([0.5] * 9)
@example([0, 0, 0, 0])
@example([3, 18, 10, 7])
@example((4, 1, 1, 1, 1))  # a heavy first layer, costs in a tuple
@example([2, 1, 1, 6])  # a heavy last layer: a last stage of one layer
@example([0.1] * 10)  # sums that floats round
@example([7e11, 2e12, 1e12, 1.5e12])  # FLOPs
@given(layer_costs.flatmap(lambda costs: st.sampled_from([costs, tuple(costs)])))
def test_bottleneck_is_the_smallest_possible(impl, costs):
    # Every number of stages, 1 .. len(costs), for each drawn list of costs.
    balanced_bounds = impl("partition").balanced_bounds
    for n_stages, best in best_bottlenecks(costs).items():
        assert_optimal(balanced_bounds, costs, n_stages, best)
