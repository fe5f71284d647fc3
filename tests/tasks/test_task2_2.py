"""Task 2.2: the bubble fraction, from its closed form and from a trace of events.

The references are computed here: (p - 1) / (m + p - 1) (GPipe §2.3; Megatron-LM SC21
§2.2.1), and 1 - busy / (devices x makespan) over hand-built traces, among them a GPipe
step whose every start and end is written as a formula.  Every answer must be a plain
``float`` (``Fraction(3, 11)``, ``0`` and ``numpy.float64`` pass ``==`` but are not), and
the events must come back unchanged, whether given as a list or a tuple, in any order.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contract import assert_type, call_with_lists_then_tuples

pytestmark = pytest.mark.task2_2

FORMULA = "bubble_fraction_formula returns (p - 1) / (m + p - 1), the bubble's share of the step"
DEFINITION = "bubble_fraction_from_events returns 1 - sum(end - start) / (n_devices x makespan)"
A_FLOAT = "returns a float"


def formula(impl, n_stages, n_microbatches):
    got = impl("bubble").bubble_fraction_formula(n_stages, n_microbatches)
    assert_type(got, float, f"bubble_fraction_formula {A_FLOAT}",
                f"bubble_fraction_formula({n_stages}, {n_microbatches})")
    return got


def from_events(impl, events, n_devices):
    """The answer for ``events`` as a list, checked to be a float, to leave the list as it
    was, and to be the same for the events as a tuple."""
    call = f"bubble_fraction_from_events({events!r}, {n_devices})"
    events = list(events)
    return call_with_lists_then_tuples(
        impl("bubble").bubble_fraction_from_events, (events, n_devices), (tuple(events), n_devices),
        watched=events, what="events", call=call,
        check=lambda got: assert_type(got, float, f"bubble_fraction_from_events {A_FLOAT}", call),
        differs=lambda got, again: f"events may be a list or a tuple\n{call} gave {got}, for a tuple {again}",
    )


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
    got = formula(impl, 4, 8)
    assert got == pytest.approx(3 / 11), (
        f"{FORMULA}\nbubble_fraction_formula(4, 8) = {got}: the bubble's share of the *step* is "
        "(p - 1) / (m + p - 1) = 3/11 ((p - 1) / m = 3/8 compares it to the ideal time)"
    )


def test_formula_one_stage_has_no_bubble_one_microbatch_is_mostly_bubble(impl):
    for p, m, expected in [(1, 5, 0.0), (1, 1, 0.0), (4, 1, 3 / 4), (2, 1, 1 / 2)]:
        got = formula(impl, p, m)
        assert got == pytest.approx(expected), f"{FORMULA}\nbubble_fraction_formula({p}, {m}) = {got}"


def test_formula_on_a_grid(impl):
    for p in range(1, 9):
        for m in range(1, 33):
            got = formula(impl, p, m)
            assert got == pytest.approx((p - 1) / (m + p - 1)), (
                f"{FORMULA}\nbubble_fraction_formula({p}, {m}) = {got}"
            )


def test_four_microbatches_per_stage_keep_the_bubble_under_a_fifth(impl):
    # GPipe §2.3: the bubble is negligible when m >= 4p.  (p - 1) / (5p - 1) < 1/5.
    for p in range(1, 17):
        assert formula(impl, p, 4 * p) < 0.2, f"{FORMULA}\nwith m = 4p the bubble is under a fifth"


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(0, 4), (4, 0), (-2, 3), (0, 0)])
def test_formula_invalid_counts_raise_value_error(impl, n_stages, n_microbatches):
    with pytest.raises(ValueError):
        impl("bubble").bubble_fraction_formula(n_stages, n_microbatches)
        pytest.fail("bubble_fraction_formula raises ValueError if n_stages < 1 or n_microbatches < 1\n"
                    f"bubble_fraction_formula({n_stages}, {n_microbatches}) returned without raising")


# ---- bubble_fraction_from_events ----------------------------------------------------------


def test_events_docstring_example(impl):
    events = [(0, 0.0, 1.0), (1, 1.0, 3.0), (0, 3.0, 4.0)]
    got = from_events(impl, events, 2)
    assert got == pytest.approx(0.5), (
        f"{DEFINITION}\nbubble_fraction_from_events({events}, 2) = {got}: 4 s busy out of 2 devices x 4 s"
    )


@pytest.mark.parametrize(
    ("n_stages", "n_microbatches", "forward_s", "backward_s"),
    [(4, 8, 1.0, 2.0), (2, 3, 0.5, 0.5), (8, 32, 1.0, 3.0), (1, 4, 2.0, 1.0)],
)
def test_events_of_a_gpipe_step_give_the_formula(impl, n_stages, n_microbatches, forward_s, backward_s):
    events = gpipe_events(n_stages, n_microbatches, forward_s, backward_s)
    got = from_events(impl, events, n_stages)
    expected = (n_stages - 1) / (n_microbatches + n_stages - 1)
    assert got == pytest.approx(expected), (
        f"{DEFINITION}\nGPipe, p={n_stages}, m={n_microbatches}: got {got}, expected (p - 1) / (m + p - 1) "
        f"= {expected}"
    )


def test_a_step_that_starts_late_has_the_same_bubble(impl):
    # Timestamps from a real clock rarely start at 0: the step begins at its first start.
    events = gpipe_events(4, 8, 1.0, 2.0, offset_s=100.0)
    got = from_events(impl, events, 4)
    assert got == pytest.approx(3 / 11), (
        f"{DEFINITION}, makespan = max(end) - min(start)\nGPipe p=4, m=8 starting at t=100 s: got {got}, expected 3/11; the makespan is "
        "max(end) - min(start), not max(end)"
    )


def test_a_device_without_events_is_idle_all_step(impl):
    events = [(0, 0.0, 2.0), (1, 0.0, 2.0)]  # device 2 never computes
    got = from_events(impl, events, 3)
    assert got == pytest.approx(1 / 3), (
        f"a device with no event at all was idle for the whole step and counts too\n3 devices, of which 2 compute for the whole 2 s step: got {got}, expected "
        "1 - 4 / (3 x 2) = 1/3 (count n_devices, not the devices seen in the events)"
    )


def test_idle_share_not_idle_over_work(impl):
    events = [(0, 0.0, 1.0), (1, 1.0, 2.0)]
    got = from_events(impl, events, 2)
    assert got == pytest.approx(0.5), (
        f"{DEFINITION}\n2 devices, each busy 1 s of a 2 s step: got {got}, expected 1 - 2 / (2 x 2) = 0.5 "
        "(idle time over devices x makespan, not over the busy time)"
    )


def test_zero_makespan_gives_zero(impl):
    for events in ([(0, 1.0, 1.0), (1, 1.0, 1.0)], [(0, 3, 3)]):
        got = from_events(impl, events, 2)
        assert got == 0.0, f"when the makespan is 0 the answer is 0.0\ngot {got} for {events}"


def test_events_in_any_order(impl):
    # A trace gathered device by device, or shuffled, is not sorted by time.
    events = gpipe_events(3, 4, 1.0, 2.0, offset_s=5.0)
    for ordered in (events[::-1], sorted(events, key=lambda e: (e[0], -e[1])), events[1:] + events[:1]):
        got = from_events(impl, ordered, 3)
        assert got == pytest.approx(2 / 6), (
            f"{DEFINITION}, whatever the order of the events\nGPipe p=3, m=4 listed out of time "
            f"order gave {got}, expected (p - 1) / (m + p - 1) = 1/3"
        )


def test_integer_times_give_a_float(impl):
    got = from_events(impl, [(0, 0, 1), (1, 1, 3), (0, 3, 4)], 2)
    assert got == pytest.approx(0.5), f"{DEFINITION}\ngot {got}"


@pytest.mark.parametrize(
    ("events", "n_devices", "why"),
    [
        ([(0, 0.0, 1.0)], 0, "n_devices < 1"),
        ([], 2, "events is empty"),
        ((), 2, "events is empty"),
        ([(0, 0.0, 1.0), (1, 2.0, 1.5)], 2, "an event ends before it starts"),
        ([(0, 0.0, 1.0), (2, 0.0, 1.0)], 2, "an event's device is not one of 0 .. n_devices - 1"),
        ([(-1, 0.0, 1.0)], 2, "an event's device is not one of 0 .. n_devices - 1"),
    ],
    ids=["zero_devices", "no_events", "no_events_tuple", "ends_before_start", "device_too_large",
         "negative_device"],
)
def test_events_invalid_arguments_raise_value_error(impl, events, n_devices, why):
    with pytest.raises(ValueError):
        impl("bubble").bubble_fraction_from_events(events, n_devices)
        pytest.fail(f"bubble_fraction_from_events raises ValueError if {why}\n"
                    f"bubble_fraction_from_events({events}, {n_devices}) returned without raising")


@st.composite
def traces(draw):
    n_devices = draw(st.integers(1, 4))
    event = st.tuples(
        st.integers(0, n_devices - 1), st.integers(0, 50), st.integers(0, 10)
    ).map(lambda e: (e[0], e[1] / 4, (e[1] + e[2]) / 4))
    return draw(st.lists(event, min_size=1, max_size=12)), n_devices


@settings(max_examples=100, deadline=None)
@example(([(1, 2.0, 3.0), (0, 0.5, 1.0), (0, 1.0, 2.5)], 2))  # not in time order
@example(([(0, 1.25, 1.25)], 1))  # zero makespan
@example(([(2, 0, 4), (0, 1, 2)], 4))  # integer times, idle devices
@given(traces())
def test_events_match_the_definition(impl, trace):
    events, n_devices = trace
    makespan = max(end for _, _, end in events) - min(start for _, start, _ in events)
    busy = sum(end - start for _, start, end in events)
    expected = 1 - busy / (n_devices * makespan) if makespan else 0.0
    got = from_events(impl, events, n_devices)
    assert got == pytest.approx(expected), (
        f"{DEFINITION}\nbubble_fraction_from_events({events}, {n_devices}) = {got}, expected "
        f"1 - {busy} / ({n_devices} x {makespan}) = {expected}"
    )
