"""Task 2.3: simulate_core, the loop that times a schedule.

The references are written out here: GPipe and 1F1B tables, the closed-form start of
every action of a GPipe step with equal stages, a makespan of (m + p - 1)(t_F + t_B)
for both, and small cases with uneven durations computed by hand.  A property test
checks the rule itself on random durations: each action starts when its device is free
and its dependencies have ended.  Schedules that deadlock must raise ValueError, not hang.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from schedule_tables import gpipe_table, one_f_one_b_table

# Hypothesis's explain phase costs seconds per failing property, more than it tells here.
PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)

pytestmark = pytest.mark.task2_3


def inputs_of(action, n_stages):
    """F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i)."""
    kind, stage, mb = action
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < n_stages - 1 else [])


def by_kind(forward_s, backward_s):
    return lambda action: forward_s if action[0] == "F" else backward_s


def assert_times_every_action(times, table):
    assert isinstance(times, dict), f"simulate_core should return a dict, got {type(times).__name__}"
    expected = {action for row in table for action in row}
    assert set(times) == expected, (
        f"simulate_core should time exactly the actions of the table; missing "
        f"{sorted(expected - set(times))}, extra {sorted(set(times) - expected)}"
    )


def test_docstring_example(impl):
    table = [[("F", 0, 0), ("B", 0, 0)], [("F", 1, 0), ("B", 1, 0)]]
    times = impl("simulator").simulate_core(table, 2, by_kind(1.0, 2.0))
    assert times == {
        ("F", 0, 0): (0.0, 1.0), ("F", 1, 0): (1.0, 2.0),
        ("B", 1, 0): (2.0, 4.0), ("B", 0, 0): (4.0, 6.0),
    }


@pytest.mark.parametrize(
    ("p", "m", "forward_s", "backward_s"),
    [(4, 8, 1.0, 2.0), (2, 2, 1.0, 1.0), (3, 5, 0.5, 1.5), (1, 3, 2.0, 1.0), (5, 1, 1.0, 3.0)],
)
def test_gpipe_every_action_at_its_closed_form_time(impl, p, m, forward_s, backward_s):
    table = gpipe_table(p, m)
    times = impl("simulator").simulate_core(table, p, by_kind(forward_s, backward_s))
    assert_times_every_action(times, table)
    for s in range(p):
        for i in range(m):
            start = (s + i) * forward_s
            assert times[("F", s, i)] == pytest.approx((start, start + forward_s)), (
                f"GPipe p={p}, m={m}: F(stage {s}, mb {i}) at {times[('F', s, i)]}, expected "
                f"to start at (s + i) t_F = {start}"
            )
            start = (m + p - 1) * forward_s + (p - 1 - s + i) * backward_s
            assert times[("B", s, i)] == pytest.approx((start, start + backward_s)), (
                f"GPipe p={p}, m={m}: B(stage {s}, mb {i}) at {times[('B', s, i)]}, expected "
                f"to start at (m + p - 1) t_F + (p - 1 - s + i) t_B = {start}"
            )


@pytest.mark.parametrize("schedule", [gpipe_table, one_f_one_b_table], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (3, 2), (6, 6), (1, 4), (8, 3)])
def test_makespan_is_m_plus_p_minus_1_rounds(impl, schedule, p, m):
    forward_s, backward_s = 1.0, 2.5
    table = schedule(p, m)
    times = impl("simulator").simulate_core(table, p, by_kind(forward_s, backward_s))
    assert_times_every_action(times, table)
    makespan = max(end for _, end in times.values()) - min(start for start, _ in times.values())
    assert makespan == pytest.approx((m + p - 1) * (forward_s + backward_s)), (
        f"{schedule.__name__}({p}, {m}) with t_F={forward_s}, t_B={backward_s}: makespan "
        f"{makespan}, expected (m + p - 1)(t_F + t_B) = {(m + p - 1) * (forward_s + backward_s)}"
    )


def test_uneven_stages_gpipe_by_hand(impl):
    # Stage 0: F 1 s, B 2 s; stage 1: F 3 s, B 1 s.  Stage 1 is the bottleneck: stage 0
    # waits for its gradients, and B(0, 1) waits for its own device (busy until 10), not
    # for B(1, 1) (done at 9).
    seconds = {("F", 0): 1.0, ("B", 0): 2.0, ("F", 1): 3.0, ("B", 1): 1.0}
    times = impl("simulator").simulate_core(gpipe_table(2, 2), 2, lambda a: seconds[a[0], a[1]])
    assert times == {
        ("F", 0, 0): (0.0, 1.0), ("F", 0, 1): (1.0, 2.0),
        ("F", 1, 0): (1.0, 4.0), ("F", 1, 1): (4.0, 7.0),
        ("B", 1, 0): (7.0, 8.0), ("B", 1, 1): (8.0, 9.0),
        ("B", 0, 0): (8.0, 10.0), ("B", 0, 1): (10.0, 12.0),
    }


def test_uneven_stages_1f1b_by_hand(impl):
    # Stage 0: F 1 s, B 2 s; stage 1: F 2 s, B 4 s.  Device 1 runs F0 B0 F1 B1, so F(1, 1)
    # waits for its device (free at 7) although its input is ready at 2.
    seconds = {("F", 0): 1.0, ("B", 0): 2.0, ("F", 1): 2.0, ("B", 1): 4.0}
    table = [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
        [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)],
    ]
    times = impl("simulator").simulate_core(table, 2, lambda a: seconds[a[0], a[1]])
    assert times == {
        ("F", 0, 0): (0.0, 1.0), ("F", 0, 1): (1.0, 2.0),
        ("F", 1, 0): (1.0, 3.0), ("B", 1, 0): (3.0, 7.0),
        ("F", 1, 1): (7.0, 9.0), ("B", 1, 1): (9.0, 13.0),
        ("B", 0, 0): (7.0, 9.0), ("B", 0, 1): (13.0, 15.0),
    }


def test_two_stages_on_one_device_run_back_to_back(impl):
    # One device runs both stages: nothing overlaps, the step is the sum of the durations.
    table = [[("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]]
    times = impl("simulator").simulate_core(table, 2, by_kind(1.0, 2.0))
    assert times == {
        ("F", 0, 0): (0.0, 1.0), ("F", 1, 0): (1.0, 2.0),
        ("B", 1, 0): (2.0, 4.0), ("B", 0, 0): (4.0, 6.0),
    }


@pytest.mark.parametrize("schedule", [gpipe_table, one_f_one_b_table], ids=["gpipe", "1f1b"])
def test_the_order_of_the_devices_does_not_matter(impl, schedule):
    # Stage s on device p-1-s: the last stage's list comes first.  Same actions, same times.
    simulate_core = impl("simulator").simulate_core
    seconds = {("F", s): 1.0 + s / 2 for s in range(4)} | {("B", s): 2.0 + s for s in range(4)}
    duration = lambda a: seconds[a[0], a[1]]  # noqa: E731
    table = schedule(4, 6)
    in_order = simulate_core(table, 4, duration)
    reversed_devices = simulate_core(table[::-1], 4, duration)
    assert reversed_devices == in_order, (
        "the same schedule with its devices listed last stage first got different times: "
        "a device may have to wait for one listed after it"
    )


def assert_stuck_with_value_error(simulate_core, table, n_stages, stuck):
    with pytest.raises(ValueError) as raised:
        simulate_core(table, n_stages, by_kind(1.0, 2.0))
        pytest.fail(f"simulate_core({table}, {n_stages}, ...) deadlocks and should raise ValueError")
    message = str(raised.value)
    assert any(repr(action) in message for action in stuck), (
        f"the ValueError should name a stuck action, one of {stuck}, as its tuple; it says: {message}"
    )


def test_two_devices_waiting_for_each_other_raise_value_error(impl):
    # Device 1 runs F(1, 1) first, which needs F(0, 1); device 0 only gets there after
    # B(0, 0), which needs B(1, 0), which device 1 only runs after F(1, 1): a cycle.
    table = [
        [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
        [("F", 1, 1), ("F", 1, 0), ("B", 1, 0), ("B", 1, 1)],
    ]
    assert_stuck_with_value_error(impl("simulator").simulate_core, table, 2, [("B", 0, 0), ("F", 1, 1)])


def test_a_backward_listed_before_its_forward_raises_value_error(impl):
    table = [[("B", 0, 0), ("F", 0, 0)]]
    assert_stuck_with_value_error(impl("simulator").simulate_core, table, 1, [("B", 0, 0)])


def test_a_dependency_in_no_list_raises_value_error(impl):
    # Stage 1's backward is missing, so B(0, 0) never gets its gradient.
    table = [[("F", 0, 0), ("B", 0, 0)], [("F", 1, 0)]]
    assert_stuck_with_value_error(impl("simulator").simulate_core, table, 2, [("B", 0, 0)])


@st.composite
def schedules_with_durations(draw):
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    table = draw(st.sampled_from([gpipe_table, one_f_one_b_table]))(p, m)
    actions = [action for row in table for action in row]
    seconds = draw(st.lists(st.integers(0, 8), min_size=len(actions), max_size=len(actions)))
    return table, p, {action: s / 4 for action, s in zip(actions, seconds)}


@settings(max_examples=60, deadline=None, phases=PHASES)
@given(schedules_with_durations())
def test_each_action_starts_when_its_device_and_inputs_are_ready(impl, case):
    table, p, seconds = case
    times = impl("simulator").simulate_core(table, p, lambda action: seconds[tuple(action)])
    assert_times_every_action(times, table)
    for device, row in enumerate(table):
        device_free = 0.0
        for action in row:
            needs = inputs_of(action, p)
            ready = max([device_free] + [times[need][1] for need in needs])
            start, end = times[action]
            assert (start, end) == pytest.approx((ready, ready + seconds[action])), (
                f"{action} on device {device} runs {start}..{end}; its device is free at "
                f"{device_free} and its inputs {needs} end at {[times[n][1] for n in needs]}, so "
                f"it should run {ready}..{ready + seconds[action]} (duration {seconds[action]})"
            )
            device_free = end
