"""Task 1.1: balanced_bounds, the optimal split of layer costs into pipeline stages.

The reference is brute force: try every way to place the n_stages - 1 cuts.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

# Hypothesis's explain phase costs seconds per failing property, more than it tells here.
PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)

pytestmark = pytest.mark.task1_1


def bottleneck(costs, bounds) -> float:
    """The cost of the slowest stage: max_s sum_{start_s <= i < end_s} c_i."""
    return max(sum(costs[start:end]) for start, end in bounds)


def best_bottleneck(costs, n_stages) -> tuple[float, list[tuple[int, int]]]:
    """Brute force over all C(n - 1, n_stages - 1) placements of the cuts."""
    n_layers = len(costs)
    best = (float("inf"), [])
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        edges = (0, *cuts, n_layers)
        bounds = list(zip(edges[:-1], edges[1:]))
        best = min(best, (bottleneck(costs, bounds), bounds))
    return best


def assert_valid_partition(bounds, n_layers, n_stages, call):
    assert isinstance(bounds, list), f"{call} should return a list, got {type(bounds).__name__}"
    assert len(bounds) == n_stages, f"{call} returned {len(bounds)} stages: {bounds}"
    ends = [0]
    for stage, bound in enumerate(bounds):
        assert isinstance(bound, tuple) and len(bound) == 2, (
            f"{call}: stage {stage} is {bound!r}, expected a (start, end) tuple"
        )
        start, end = bound
        assert start == ends[-1], (
            f"{call} returned {bounds}: stage {stage} starts at {start}, but the previous "
            f"stage ends at {ends[-1]} (bounds are half-open: (start, end) holds start..end-1)"
        )
        assert end > start, f"{call} returned {bounds}: stage {stage} is empty"
        ends.append(end)
    assert ends[-1] == n_layers, f"{call} returned {bounds}, which does not end at {n_layers}"


def assert_optimal(balanced_bounds, costs, n_stages):
    call = f"balanced_bounds({costs}, {n_stages})"
    bounds = balanced_bounds(costs, n_stages)
    assert_valid_partition(bounds, len(costs), n_stages, call)
    best, best_bounds = best_bottleneck(costs, n_stages)
    assert bottleneck(costs, bounds) == pytest.approx(best), (
        f"{call} returned {bounds}, whose slowest stage costs {bottleneck(costs, bounds)}; "
        f"{best_bounds} does better, with a slowest stage of {best}"
    )


def test_source_example_eight_equal_layers_on_four_devices(impl):
    bounds = impl("partition").balanced_bounds([1.0] * 8, 4)
    assert bounds == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_heavy_last_layer_gets_a_stage_of_its_own(impl):
    # Equal layer counts would give [(0, 2), (2, 5)]: bottleneck 6 instead of 4.
    assert impl("partition").balanced_bounds([1, 1, 1, 1, 4], 2) == [(0, 4), (4, 5)]


def test_filling_stages_greedily_is_not_enough(impl):
    # Filling up to sum / n_stages = 5 gives [(0, 1), (1, 4)]: bottleneck 7 instead of 6.
    assert_optimal(impl("partition").balanced_bounds, [3, 3, 2, 2], 2)


def test_one_stage_and_one_layer_per_stage(impl):
    balanced_bounds = impl("partition").balanced_bounds
    assert balanced_bounds([2.0, 5.0, 1.0], 1) == [(0, 3)]
    assert balanced_bounds([2.0, 5.0, 1.0], 3) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize(
    ("costs", "n_stages", "why"),
    [
        ([1.0, 2.0], 0, "n_stages < 1"),
        ([1.0, 2.0], 3, "more stages than layers: a stage would be empty"),
        ([1.0, -2.0, 3.0], 2, "a negative cost"),
    ],
    ids=["zero_stages", "more_stages_than_layers", "negative_cost"],
)
def test_invalid_arguments_raise_value_error(impl, costs, n_stages, why):
    with pytest.raises(ValueError):
        impl("partition").balanced_bounds(costs, n_stages)
        pytest.fail(f"balanced_bounds({costs}, {n_stages}) should raise ValueError ({why})")


layer_cost = st.integers(0, 20) | st.floats(0, 20, allow_nan=False, allow_infinity=False)


@st.composite
def costs_and_n_stages(draw):
    costs = draw(st.lists(layer_cost, min_size=1, max_size=9))
    return costs, draw(st.integers(1, len(costs)))


@settings(max_examples=150, deadline=None, phases=PHASES)
@given(costs_and_n_stages())
def test_bottleneck_is_the_smallest_possible(impl, case):
    costs, n_stages = case
    assert_optimal(impl("partition").balanced_bounds, costs, n_stages)
