"""Task 2.2: the bubble fraction, from its closed form and from a trace of events.

The references are computed here: (p - 1) / (m + p - 1) (GPipe §2.3; Megatron-LM SC21
§2.2.1), and 1 - busy / (devices x makespan) over hand-built traces, among them a GPipe
step whose every start and end is written as a formula.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

# Hypothesis's explain phase costs seconds per failing property, more than it tells here.
PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)

pytestmark = pytest.mark.task2_2


def gpipe_events(n_stages, n_microbatches, forward_s, backward_s, offset_s=0.0):
    """(device, start, end) of every action of a GPipe step with equal stages: F(s, i)
    starts at (s + i) t_F; B(s, i) at (m + p - 1) t_F + (p - 1 - s + i) t_B."""
    p, m = n_stages, n_microbatches
    events = []
    for s in range(p):
        for i in range(m):
            start = offset_s + (s + i) * forward_s
            events.append((s, start, start + forward_s))
            start = offset_s + (m + p - 1) * forward_s + (p - 1 - s + i) * backward_s
            events.append((s, start, start + backward_s))
    return events


# ---- bubble_fraction_formula ------------------------------------------------------------


def test_formula_four_stages_eight_microbatches(impl):
    got = impl("bubble").bubble_fraction_formula(4, 8)
    assert got == pytest.approx(3 / 11), (
        f"bubble_fraction_formula(4, 8) = {got}: the bubble's share of the *step* is "
        "(p - 1) / (m + p - 1) = 3/11 ((p - 1) / m = 3/8 compares it to the ideal time)"
    )


def test_formula_one_stage_has_no_bubble_one_microbatch_is_mostly_bubble(impl):
    bubble_fraction_formula = impl("bubble").bubble_fraction_formula
    assert bubble_fraction_formula(1, 5) == 0.0
    assert bubble_fraction_formula(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction_formula(2, 1) == pytest.approx(1 / 2)


def test_formula_on_a_grid(impl):
    bubble_fraction_formula = impl("bubble").bubble_fraction_formula
    for p in range(1, 9):
        for m in range(1, 33):
            got = bubble_fraction_formula(p, m)
            assert got == pytest.approx((p - 1) / (m + p - 1)), (
                f"bubble_fraction_formula({p}, {m}) = {got}, expected (p - 1) / (m + p - 1)"
            )


def test_four_microbatches_per_stage_keep_the_bubble_under_a_fifth(impl):
    # GPipe §2.3: the bubble is negligible when m >= 4p.  (p - 1) / (5p - 1) < 1/5.
    bubble_fraction_formula = impl("bubble").bubble_fraction_formula
    for p in range(1, 17):
        assert bubble_fraction_formula(p, 4 * p) < 0.2


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(0, 4), (4, 0), (-2, 3)])
def test_formula_invalid_counts_raise_value_error(impl, n_stages, n_microbatches):
    with pytest.raises(ValueError):
        impl("bubble").bubble_fraction_formula(n_stages, n_microbatches)
        pytest.fail(f"bubble_fraction_formula({n_stages}, {n_microbatches}) should raise ValueError")


# ---- bubble_fraction_from_events ----------------------------------------------------------


def test_events_docstring_example(impl):
    events = [(0, 0.0, 1.0), (1, 1.0, 3.0), (0, 3.0, 4.0)]
    got = impl("bubble").bubble_fraction_from_events(events, 2)
    assert got == pytest.approx(0.5), (
        f"bubble_fraction_from_events({events}, 2) = {got}: 4 s busy out of 2 devices x 4 s"
    )


@pytest.mark.parametrize(
    ("n_stages", "n_microbatches", "forward_s", "backward_s"),
    [(4, 8, 1.0, 2.0), (2, 3, 0.5, 0.5), (8, 32, 1.0, 3.0), (1, 4, 2.0, 1.0)],
)
def test_events_of_a_gpipe_step_give_the_formula(impl, n_stages, n_microbatches, forward_s, backward_s):
    events = gpipe_events(n_stages, n_microbatches, forward_s, backward_s)
    got = impl("bubble").bubble_fraction_from_events(events, n_stages)
    expected = (n_stages - 1) / (n_microbatches + n_stages - 1)
    assert got == pytest.approx(expected), (
        f"GPipe, p={n_stages}, m={n_microbatches}: got {got}, expected (p - 1) / (m + p - 1) "
        f"= {expected}"
    )


def test_a_step_that_starts_late_has_the_same_bubble(impl):
    # Timestamps from a real clock rarely start at 0: the step begins at its first start.
    events = gpipe_events(4, 8, 1.0, 2.0, offset_s=100.0)
    got = impl("bubble").bubble_fraction_from_events(events, 4)
    assert got == pytest.approx(3 / 11), (
        f"GPipe p=4, m=8 starting at t=100 s: got {got}, expected 3/11; the makespan is "
        "max(end) - min(start), not max(end)"
    )


def test_a_device_without_events_is_idle_all_step(impl):
    events = [(0, 0.0, 2.0), (1, 0.0, 2.0)]  # device 2 never computes
    got = impl("bubble").bubble_fraction_from_events(events, 3)
    assert got == pytest.approx(1 / 3), (
        f"3 devices, of which 2 compute for the whole 2 s step: got {got}, expected "
        "1 - 4 / (3 x 2) = 1/3 (count n_devices, not the devices seen in the events)"
    )


def test_idle_share_not_idle_over_work(impl):
    events = [(0, 0.0, 1.0), (1, 1.0, 2.0)]
    got = impl("bubble").bubble_fraction_from_events(events, 2)
    assert got == pytest.approx(0.5), (
        f"2 devices, each busy 1 s of a 2 s step: got {got}, expected 1 - 2 / (2 x 2) = 0.5 "
        "(idle time over devices x makespan, not over the busy time)"
    )


def test_zero_makespan_gives_zero(impl):
    assert impl("bubble").bubble_fraction_from_events([(0, 1.0, 1.0), (1, 1.0, 1.0)], 2) == 0.0


@pytest.mark.parametrize(
    ("events", "n_devices", "why"),
    [
        ([(0, 0.0, 1.0)], 0, "n_devices < 1"),
        ([], 2, "no events"),
        ([(0, 0.0, 1.0), (1, 2.0, 1.5)], 2, "an event that ends before it starts"),
        ([(0, 0.0, 1.0), (2, 0.0, 1.0)], 2, "device 2 of 2 devices (0 and 1)"),
        ([(-1, 0.0, 1.0)], 2, "device -1"),
    ],
    ids=["zero_devices", "no_events", "ends_before_start", "device_too_large", "negative_device"],
)
def test_events_invalid_arguments_raise_value_error(impl, events, n_devices, why):
    with pytest.raises(ValueError):
        impl("bubble").bubble_fraction_from_events(events, n_devices)
        pytest.fail(f"bubble_fraction_from_events({events}, {n_devices}) should raise ValueError ({why})")


@st.composite
def traces(draw):
    n_devices = draw(st.integers(1, 4))
    event = st.tuples(
        st.integers(0, n_devices - 1), st.integers(0, 50), st.integers(0, 10)
    ).map(lambda e: (e[0], e[1] / 4, (e[1] + e[2]) / 4))
    return draw(st.lists(event, min_size=1, max_size=12)), n_devices


@settings(max_examples=100, deadline=None, phases=PHASES)
@given(traces())
def test_events_match_the_definition(impl, trace):
    events, n_devices = trace
    makespan = max(end for _, _, end in events) - min(start for _, start, _ in events)
    busy = sum(end - start for _, start, end in events)
    expected = 1 - busy / (n_devices * makespan) if makespan else 0.0
    got = impl("bubble").bubble_fraction_from_events(events, n_devices)
    assert got == pytest.approx(expected), (
        f"bubble_fraction_from_events({events}, {n_devices}) = {got}, expected "
        f"1 - {busy} / ({n_devices} x {makespan}) = {expected}"
    )
