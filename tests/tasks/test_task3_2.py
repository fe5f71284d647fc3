"""Task 3.2: peak_inflight and peak_activation_bytes, memory read from a trace.

The references are computed here: hand-built traces (ties, overlapping events), unit-time
GPipe and 1F1B steps built from their tables (m on every stage; min(p - s, m) on stage
s), and, for random traces, a brute-force count of what is held at every instant.
Every answer must be a list of int, the same for a trace given as a list or a tuple
(listed in any order), which it leaves unchanged; both functions raise the errors they
share.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contract import assert_type, call_with_lists_then_tuples
from schedule_tables import gpipe_table, one_f_one_b_table

pytestmark = pytest.mark.task3_2

INFLIGHT = "a micro-batch is in flight on stage s over [start of F(s, i), end of B(s, i))"
BYTES = "stage s holds bytes_per_microbatch[s] for micro-batch i over [end of F(s, i), end of B(s, i))"
TIES = "a release and an acquisition at the same instant do not overlap"


def call_both_ways(function, name, events, *args):
    """``function(events, *args)`` checked to return a list of int, to leave its
    arguments unchanged, and to give the same for the events as a tuple."""
    call = f"{name}({events!r}, {', '.join(map(repr, args))})"
    events = list(events)
    types = f"{name} returns a list of int, one per stage"

    def check(got):
        assert_type(got, list, types, f"{call}'s result")
        for stage, value in enumerate(got):
            assert_type(value, int, types, f"{call} returned {got}; stage {stage}'s peak")

    return call_with_lists_then_tuples(
        function, (events, *args), (tuple(events), *args), watched=[events, *args], what="the arguments",
        call=call, check=check,
        differs=lambda got, again: f"events may be a list or a tuple\n{call} gave {got}, for a tuple {again}",
    )


def inflight(impl, events, n_stages):
    return call_both_ways(impl("memory").peak_inflight, "peak_inflight", events, n_stages)


def activation_bytes(impl, events, bytes_per_microbatch, n_stages):
    return call_both_ways(impl("memory").peak_activation_bytes, "peak_activation_bytes", events,
                          bytes_per_microbatch, n_stages)


def unit_time_trace(table, n_stages, seed=0) -> list[tuple[int, str, int, float, float]]:
    """Every action one step long, as soon as its device is free and its inputs are ready
    (F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i)); events shuffled."""
    start, position, free = {}, [0] * len(table), [0] * len(table)
    while any(position[d] < len(row) for d, row in enumerate(table)):
        for device, row in enumerate(table):
            while position[device] < len(row):
                kind, s, i = row[position[device]]
                needs = [("F", s - 1, i)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs = [("F", s, i)] + ([("B", s + 1, i)] if s < n_stages - 1 else [])
                if not all(need in start for need in needs):
                    break
                start[kind, s, i] = max([free[device]] + [start[need] + 1 for need in needs])
                free[device] = start[kind, s, i] + 1
                position[device] += 1
    events = [(s, kind, i, float(t), float(t + 1)) for (kind, s, i), t in start.items()]
    random.Random(seed).shuffle(events)
    return events


SCHEDULES = [(p, m) for p in (1, 2, 4, 5) for m in (1, 3, 8)]


# ---- peak_inflight --------------------------------------------------------------------


def test_docstring_example_leaving_and_entering_at_the_same_time(impl):
    trace = [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 1.0, 2.0), (0, "F", 1, 2.0, 3.0), (0, "B", 1, 3.0, 4.0)]
    got = inflight(impl, trace, 1)
    assert got == [1], (
        f"{TIES}\npeak_inflight gave {got}: micro-batch 0 leaves at t=2 (end of its B) as micro-batch 1 "
        "enters (start of its F); [start of F, end of B) intervals that only touch do not overlap"
    )


def test_a_forward_that_starts_before_a_backward_ends(impl):
    # Micro-batch 1's forward starts at 2.5, while micro-batch 0's backward runs until 3:
    # from 2.5 both are held, though micro-batch 1's forward only ends at 4.
    trace = [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 2.0, 3.0), (0, "F", 1, 2.5, 4.0), (0, "B", 1, 4.0, 5.0)]
    got = inflight(impl, trace, 1)
    assert got == [2], (
        f"{INFLIGHT}\npeak_inflight gave {got}: a micro-batch is in flight from the *start* of its F; "
        "micro-batch 1 enters at 2.5, before micro-batch 0 leaves at 3"
    )


def test_stages_are_counted_apart_and_a_stage_without_events_holds_nothing(impl):
    trace = [
        (0, "F", 0, 0.0, 1.0), (0, "F", 1, 1.0, 2.0), (1, "F", 0, 1.0, 2.0),
        (1, "B", 0, 2.0, 3.0), (0, "B", 0, 3.0, 4.0), (0, "B", 1, 4.0, 5.0),
    ]
    got = inflight(impl, trace, 3)
    assert got == [2, 1, 0], f"{INFLIGHT}, 0 for a stage without events\ngot {got}"


@pytest.mark.parametrize(("p", "m"), SCHEDULES)
def test_gpipe_holds_every_microbatch_on_every_stage(impl, p, m):
    got = inflight(impl, unit_time_trace(gpipe_table(p, m), p), p)
    assert got == [m] * p, f"{INFLIGHT}\nGPipe p={p}, m={m}: got {got}, expected m = {m} on every stage"


@pytest.mark.parametrize(("p", "m"), SCHEDULES)
def test_1f1b_holds_p_minus_s_on_stage_s(impl, p, m):
    got = inflight(impl, unit_time_trace(one_f_one_b_table(p, m), p), p)
    expected = [min(p - s, m) for s in range(p)]
    assert got == expected, (
        f"{INFLIGHT}\n1F1B p={p}, m={m} (unit time): got {got}, expected min(p - s, m) = {expected}; "
        "a micro-batch leaves at the end of its B, and a B ending at t and an F starting "
        "at t do not overlap"
    )


@pytest.mark.parametrize("n_stages", [0, -1])
def test_inflight_no_stages_raises_value_error(impl, n_stages):
    with pytest.raises(ValueError):
        impl("memory").peak_inflight([], n_stages)
        pytest.fail(f"peak_inflight raises ValueError if n_stages < 1\npeak_inflight([], {n_stages}) returned")


@pytest.mark.parametrize("stage", [2, -1])
def test_inflight_stage_out_of_range_raises_value_error(impl, stage):
    trace = [(0, "F", 0, 0.0, 1.0), (stage, "B", 0, 1.0, 2.0)]
    with pytest.raises(ValueError):
        impl("memory").peak_inflight(trace, 2)
        pytest.fail("peak_inflight raises ValueError if an event's stage is not one of 0 .. n_stages - 1\n"
                    f"peak_inflight({trace}, 2) returned")


# ---- peak_activation_bytes ------------------------------------------------------------


def test_bytes_docstring_example(impl):
    trace = [(0, "F", 0, 0.0, 1.0), (0, "F", 1, 1.0, 2.0), (0, "B", 0, 2.0, 3.0), (0, "B", 1, 3.0, 4.0)]
    got = activation_bytes(impl, trace, [100], 1)
    assert got == [200], f"{BYTES}\ngot {got}"


def test_bytes_are_held_from_the_end_of_the_forward(impl):
    # The same trace as test_a_forward_that_starts_before_a_backward_ends: two micro-batches
    # are in flight at 2.5, but micro-batch 1's activations only exist from 4, when
    # micro-batch 0's are gone (3).
    trace = [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 2.0, 3.0), (0, "F", 1, 2.5, 4.0), (0, "B", 1, 4.0, 5.0)]
    got = activation_bytes(impl, trace, [64], 1)
    assert got == [64], (
        f"{BYTES}\npeak_activation_bytes gave {got}: bytes are held from the *end* of F (micro-batch 1 "
        "from 4) to the end of B (micro-batch 0 until 3), so never both at once"
    )


def test_bytes_released_and_acquired_at_the_same_time_do_not_overlap(impl):
    # Times recorded to the millisecond: micro-batch 0's B and micro-batch 1's F both end at 3.
    trace = [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 1.0, 3.0), (0, "F", 1, 2.0, 3.0), (0, "B", 1, 3.0, 4.0)]
    got = activation_bytes(impl, trace, [64], 1)
    assert got == [64], f"{TIES}\npeak_activation_bytes gave {got}: a release at t=3 comes before an acquisition at t=3"


@pytest.mark.parametrize(("p", "m"), SCHEDULES)
def test_bytes_of_gpipe_and_1f1b_with_uneven_stages(impl, p, m):
    bytes_per_microbatch = [1000 * (s + 1) + 7 for s in range(p)]  # later stages keep more
    got = activation_bytes(impl, unit_time_trace(gpipe_table(p, m), p), bytes_per_microbatch, p)
    expected = [m * b for b in bytes_per_microbatch]
    assert got == expected, f"{BYTES}\nGPipe p={p}, m={m}, bytes {bytes_per_microbatch}: got {got}, expected {expected}"
    got = activation_bytes(impl, unit_time_trace(one_f_one_b_table(p, m), p, seed=1), tuple(bytes_per_microbatch), p)
    expected = [min(p - s, m) * b for s, b in enumerate(bytes_per_microbatch)]
    assert got == expected, (
        f"{BYTES}\n1F1B p={p}, m={m}, bytes {bytes_per_microbatch}: got {got}, expected "
        f"min(p - s, m) x bytes[s] = {expected}"
    )


def test_bytes_need_one_entry_per_stage(impl):
    trace = [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 1.0, 2.0)]
    with pytest.raises(ValueError):
        impl("memory").peak_activation_bytes(trace, [10, 20], 1)
        pytest.fail("peak_activation_bytes raises ValueError if len(bytes_per_microbatch) is not n_stages\n"
                    "peak_activation_bytes(trace, [10, 20], 1) returned")


@pytest.mark.parametrize("stage", [3, 2, -1])
def test_bytes_stage_out_of_range_raises_value_error(impl, stage):
    trace = [(0, "F", 0, 0.0, 1.0), (stage, "B", 0, 1.0, 2.0)]
    with pytest.raises(ValueError):
        impl("memory").peak_activation_bytes(trace, [10, 20], 2)
        pytest.fail("peak_activation_bytes raises ValueError, as peak_inflight, if an event's stage is "
                    f"not one of 0 .. n_stages - 1\npeak_activation_bytes({trace}, [10, 20], 2) returned")


@pytest.mark.parametrize("n_stages", [0, -1])
def test_bytes_no_stages_raises_value_error(impl, n_stages):
    bytes_per_microbatch = [] if n_stages == 0 else [10]
    with pytest.raises(ValueError):
        impl("memory").peak_activation_bytes([], bytes_per_microbatch, n_stages)
        pytest.fail("peak_activation_bytes raises ValueError, as peak_inflight, if n_stages < 1\n"
                    f"peak_activation_bytes([], {bytes_per_microbatch}, {n_stages}) returned")


def test_ties_whatever_the_order_of_the_trace(impl):
    # The acquisition is listed before the release it ties with.
    trace = [(0, "F", 1, 2.0, 3.0), (0, "B", 1, 3.0, 4.0), (0, "B", 0, 1.0, 2.0), (0, "F", 0, 0.0, 1.0)]
    got = inflight(impl, trace, 1)
    assert got == [1], f"{TIES}, in whatever order the trace lists them\npeak_inflight gave {got}"
    trace = [(0, "F", 1, 2.0, 3.0), (0, "B", 0, 1.0, 3.0), (0, "F", 0, 0.0, 1.0), (0, "B", 1, 3.0, 4.0)]
    got = activation_bytes(impl, trace, [64], 1)
    assert got == [64], f"{TIES}, in whatever order the trace lists them\npeak_activation_bytes gave {got}"


# ---- both, on random traces --------------------------------------------------------------


@st.composite
def random_traces(draw):
    """Each (stage, micro-batch) gets an F and then a B; events may overlap and tie."""
    n_stages = draw(st.integers(1, 3))
    events = []
    for stage in range(n_stages):
        for mb in range(draw(st.integers(0, 5))):
            f_start, f_len, gap, b_len = (draw(st.integers(0, 6)) for _ in range(4))
            b_start = f_start + f_len + gap
            events.append((stage, "F", mb, float(f_start), float(f_start + f_len)))
            events.append((stage, "B", mb, float(b_start), float(b_start + b_len)))
    return draw(st.permutations(events)), n_stages


def brute_force_peak(events, n_stages, held_from):
    """Max over instants t of the micro-batches with held_from(F) <= t < end of B."""
    intervals = {}
    for stage, kind, mb, start, end in events:
        interval = intervals.setdefault((stage, mb), [None, None])
        if kind == "F":
            interval[0] = held_from(start, end)
        else:
            interval[1] = end
    peak = [0] * n_stages
    for t in {event[3] for event in events} | {event[4] for event in events}:
        for stage in range(n_stages):
            held = sum(1 for (s, _), (a, b) in intervals.items() if s == stage and a <= t < b)
            peak[stage] = max(peak[stage], held)
    return peak


@settings(max_examples=80, deadline=None)
@example(([(0, "F", 1, 1.0, 2.0), (0, "B", 0, 0.0, 1.0), (0, "F", 0, 0.0, 0.0), (0, "B", 1, 2.0, 2.0)], 1))  # ties listed F first
@example(([(1, "F", 0, 0.0, 3.0), (1, "B", 0, 3.0, 3.0), (0, "F", 0, 0.0, 0.0), (0, "B", 0, 0.0, 0.0)], 3))  # zero-length events
@given(random_traces())
def test_random_traces_against_a_count_at_every_instant(impl, case):
    events, n_stages = case
    expected = brute_force_peak(events, n_stages, lambda start, end: start)
    got = inflight(impl, events, n_stages)
    assert got == expected, f"{INFLIGHT}\npeak_inflight({events}, {n_stages}) = {got}, expected {expected}"
    bytes_per_microbatch = [10 ** stage for stage in range(n_stages)]
    count = brute_force_peak(events, n_stages, lambda start, end: end)
    expected = [c * b for c, b in zip(count, bytes_per_microbatch)]
    got = activation_bytes(impl, events, bytes_per_microbatch, n_stages)
    assert got == expected, (
        f"{BYTES}\npeak_activation_bytes({events}, {bytes_per_microbatch}, {n_stages}) = {got}, expected {expected}"
    )
