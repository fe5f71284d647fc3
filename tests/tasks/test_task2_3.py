"""Task 2.3: simulate_core, the loop that times a schedule.

The references are written out here: GPipe and 1F1B tables, the closed-form start of
every action of a GPipe step with equal stages, a makespan of (m + p - 1)(t_F + t_B)
for both, and small cases with uneven durations computed by hand.  A property test
checks the rule itself on random durations: each action starts when its device is free
and its dependencies have ended.  Schedules that deadlock must raise ValueError, not hang.  Devices that run several
stages are drawn too.  Every answer must be a dict of ``(start, end)`` tuples of float (int
durations included), the same for a table of lists and of tuples, which it leaves unchanged.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contract import assert_type, call_with_lists_then_tuples
from schedule_tables import gpipe_table, one_f_one_b_table, unit_time_starts

pytestmark = pytest.mark.task2_3

RULE = ("an action starts when its device is free and its dependencies have ended: "
        "start = max(end of the previous action on its device, end of each dependency)")
TYPES = "simulate_core returns a dict {action: (start, end)}, start and end floats"
DEADLOCK = "on a deadlock simulate_core raises ValueError naming a stuck action as its tuple"


def simulate(impl, table, n_stages, duration):
    """simulate_core on ``table`` (lists), checked for its types and for leaving the table
    as it was; the same table as tuples must give the same times."""
    call = f"simulate_core({table!r}, {n_stages}, ...)"

    def check(times):
        assert_type(times, dict, TYPES, f"{call}'s result")
        for action, value in times.items():
            assert_type(value, tuple, TYPES, f"{call}: times[{action!r}]")
            assert len(value) == 2, f"{TYPES}\n{call}: times[{action!r}] is {value!r}"
            for name, number in zip(("start", "end"), value):
                assert_type(number, float, TYPES, f"{call}: the {name} of {action!r}")

    as_tuples = tuple(tuple(row) for row in table)
    return call_with_lists_then_tuples(
        impl("simulator").simulate_core, (table, n_stages, duration), (as_tuples, n_stages, duration),
        watched=table, what="actions", call=call, check=check,
        differs=lambda times, again: f"actions may be lists or tuples\n{call} gave other times for tuples: {again}",
    )


def on_fewer_devices(table, n_stages, stages_per_device):
    """The same schedule on fewer devices: device d runs stages k d .. k d + k - 1, its
    actions in the order they start when each stage has a device of its own (so every
    dependency still comes first)."""
    starts = unit_time_starts(table, n_stages)
    rows = [
        [action for row in table[first:first + stages_per_device] for action in row]
        for first in range(0, len(table), stages_per_device)
    ]
    return [sorted(row, key=lambda action: (starts[action], action[1])) for row in rows]


def inputs_of(action, n_stages):
    """F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i)."""
    kind, stage, mb = action
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < n_stages - 1 else [])


def relabeled(table, order):
    """The same schedule with micro-batch i renamed order[i] on every stage: a table whose
    stages take their micro-batches in another order, valid whenever ``table`` is."""
    return [[(kind, stage, order[mb]) for kind, stage, mb in row] for row in table]


def assert_follows_the_rule(times, table, n_stages, seconds):
    """Each action of each device starts when the device is free and its inputs have ended."""
    assert_times_every_action(times, table)
    for device, row in enumerate(table):
        device_free = 0.0
        for action in row:
            needs = inputs_of(action, n_stages)
            ready = max([device_free] + [times[need][1] for need in needs])
            start, end = times[action]
            assert (start, end) == pytest.approx((ready, ready + seconds[action])), (
                f"{RULE}\n{action} on device {device} runs {start}..{end}; its device is free at "
                f"{device_free} and its inputs {needs} end at {[times[n][1] for n in needs]}, so "
                f"it should run {ready}..{ready + seconds[action]} (duration {seconds[action]})"
            )
            device_free = end


def by_kind(forward_s, backward_s):
    return lambda action: forward_s if action[0] == "F" else backward_s


def assert_times_every_action(times, table):
    expected = {action for row in table for action in row}
    assert set(times) == expected, (
        f"simulate_core times every action of the table, and nothing else\nmissing "
        f"{sorted(expected - set(times))}, extra {sorted(set(times) - expected)}"
    )


def test_docstring_example(impl):
    table = [[("F", 0, 0), ("B", 0, 0)], [("F", 1, 0), ("B", 1, 0)]]
    times = simulate(impl, table, 2, by_kind(1.0, 2.0))
    assert_same_times(times, {
        ("F", 0, 0): (0.0, 1.0), ("F", 1, 0): (1.0, 2.0),
        ("B", 1, 0): (2.0, 4.0), ("B", 0, 0): (4.0, 6.0),
    }, "the docstring's example")


@pytest.mark.parametrize(
    ("p", "m", "forward_s", "backward_s"),
    [(4, 8, 1.0, 2.0), (2, 2, 1.0, 1.0), (3, 5, 0.5, 1.5), (1, 3, 2.0, 1.0), (5, 1, 1.0, 3.0)],
)
def test_gpipe_every_action_at_its_closed_form_time(impl, p, m, forward_s, backward_s):
    table = gpipe_table(p, m)
    times = simulate(impl, table, p, by_kind(forward_s, backward_s))
    assert_times_every_action(times, table)
    for s in range(p):
        for i in range(m):
            start = (s + i) * forward_s
            assert times[("F", s, i)] == pytest.approx((start, start + forward_s)), (
                f"{RULE}\nGPipe p={p}, m={m}: F(stage {s}, mb {i}) at {times[('F', s, i)]}, expected "
                f"to start at (s + i) t_F = {start}"
            )
            start = (m + p - 1) * forward_s + (p - 1 - s + i) * backward_s
            assert times[("B", s, i)] == pytest.approx((start, start + backward_s)), (
                f"{RULE}\nGPipe p={p}, m={m}: B(stage {s}, mb {i}) at {times[('B', s, i)]}, expected "
                f"to start at (m + p - 1) t_F + (p - 1 - s + i) t_B = {start}"
            )


@pytest.mark.parametrize("schedule", [gpipe_table, one_f_one_b_table], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (3, 2), (6, 6), (1, 4), (8, 3)])
def test_makespan_is_m_plus_p_minus_1_rounds(impl, schedule, p, m):
    forward_s, backward_s = 1.0, 2.5
    table = schedule(p, m)
    times = simulate(impl, table, p, by_kind(forward_s, backward_s))
    assert_times_every_action(times, table)
    makespan = max(end for _, end in times.values()) - min(start for start, _ in times.values())
    assert makespan == pytest.approx((m + p - 1) * (forward_s + backward_s)), (
        f"{RULE}\n{schedule.__name__}({p}, {m}) with t_F={forward_s}, t_B={backward_s}: makespan "
        f"{makespan}, expected (m + p - 1)(t_F + t_B) = {(m + p - 1) * (forward_s + backward_s)}"
    )


def test_uneven_stages_gpipe_by_hand(impl):
    # Stage 0: F 1 s, B 2 s; stage 1: F 3 s, B 1 s.  Stage 1 is the bottleneck: stage 0
    # waits for its gradients, and B(0, 1) waits for its own device (busy until 10), not
    # for B(1, 1) (done at 9).
    seconds = {("F", 0): 1.0, ("B", 0): 2.0, ("F", 1): 3.0, ("B", 1): 1.0}
    times = simulate(impl, gpipe_table(2, 2), 2, lambda a: seconds[a[0], a[1]])
    assert_same_times(times, {
        ("F", 0, 0): (0.0, 1.0), ("F", 0, 1): (1.0, 2.0),
        ("F", 1, 0): (1.0, 4.0), ("F", 1, 1): (4.0, 7.0),
        ("B", 1, 0): (7.0, 8.0), ("B", 1, 1): (8.0, 9.0),
        ("B", 0, 0): (8.0, 10.0), ("B", 0, 1): (10.0, 12.0),
    }, "GPipe, p=2, m=2, uneven stages")


def test_uneven_stages_1f1b_by_hand(impl):
    # Stage 0: F 1 s, B 2 s; stage 1: F 2 s, B 4 s.  Device 1 runs F0 B0 F1 B1, so F(1, 1)
    # waits for its device (free at 7) although its input is ready at 2.
    seconds = {("F", 0): 1.0, ("B", 0): 2.0, ("F", 1): 2.0, ("B", 1): 4.0}
    table = [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
        [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)],
    ]
    times = simulate(impl, table, 2, lambda a: seconds[a[0], a[1]])
    assert_same_times(times, {
        ("F", 0, 0): (0.0, 1.0), ("F", 0, 1): (1.0, 2.0),
        ("F", 1, 0): (1.0, 3.0), ("B", 1, 0): (3.0, 7.0),
        ("F", 1, 1): (7.0, 9.0), ("B", 1, 1): (9.0, 13.0),
        ("B", 0, 0): (7.0, 9.0), ("B", 0, 1): (13.0, 15.0),
    }, "1F1B, p=2, m=2, uneven stages")


def assert_same_times(times, expected, case):
    assert times == expected, f"{RULE}\n{case}: got {times}, expected {expected}"


def test_two_stages_on_one_device_run_back_to_back(impl):
    # One device runs both stages: nothing overlaps, the step is the sum of the durations.
    table = [[("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]]
    times = simulate(impl, table, 2, by_kind(1.0, 2.0))
    assert_same_times(times, {
        ("F", 0, 0): (0.0, 1.0), ("F", 1, 0): (1.0, 2.0),
        ("B", 1, 0): (2.0, 4.0), ("B", 0, 0): (4.0, 6.0),
    }, "two stages on one device")


def test_two_stages_on_one_device_with_several_microbatches(impl):
    # The device is busy with stage 0 while stage 1's next input is ready: one at a time.
    table = [[("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
              ("B", 1, 0), ("B", 0, 0), ("B", 1, 1), ("B", 0, 1)]]
    times = simulate(impl, table, 2, by_kind(1.0, 2.0))
    ends = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    expected = {action: (end - (1.0 if action[0] == "F" else 2.0), end) for action, end in zip(table[0], ends)}
    assert_same_times(times, expected, "two stages on one device, two micro-batches")


def test_four_stages_on_two_devices(impl):
    table = on_fewer_devices(one_f_one_b_table(4, 3), 4, 2)
    times = simulate(impl, table, 4, by_kind(1.0, 2.0))
    assert_times_every_action(times, table)
    for row in table:
        spans = sorted(times[a] for a in row)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (
            f"{RULE} (one action at a time on each device)\ntwo actions of one device overlap: {spans}"
        )


@pytest.mark.parametrize("schedule", [gpipe_table, one_f_one_b_table], ids=["gpipe", "1f1b"])
def test_microbatches_taken_in_another_order(impl, schedule):
    # Renaming the micro-batches renames the times: micro-batch 2 first, then 0, 3, 1.
    order = [2, 0, 3, 1]
    seconds = {("F", s): 1.0 + s for s in range(3)} | {("B", s): 2.5 - s / 2 for s in range(3)}
    duration = lambda a: seconds[a[0], a[1]]  # noqa: E731
    plain = simulate(impl, schedule(3, 4), 3, duration)
    renamed = simulate(impl, relabeled(schedule(3, 4), order), 3, duration)
    expected = {(kind, stage, order[mb]): time for (kind, stage, mb), time in plain.items()}
    assert renamed == expected, (
        f"{RULE}, whatever order a stage takes its micro-batches in\nthe same {schedule.__name__}(3, 4) "
        f"with micro-batch i renamed {order}[i] got other times: {renamed}"
    )


def test_backwards_last_microbatch_first(impl):
    # GPipe with every stage running its backwards B(s, m-1) .. B(s, 0): valid, not ascending.
    table = [[("F", s, i) for i in range(4)] + [("B", s, i) for i in reversed(range(4))] for s in range(3)]
    seconds = {action: 1.0 + action[1] / 4 if action[0] == "F" else 2.0 for row in table for action in row}
    times = simulate(impl, table, 3, lambda action: seconds[action])
    assert_follows_the_rule(times, table, 3, seconds)


def test_integer_durations_give_float_times(impl):
    times = simulate(impl, gpipe_table(2, 2), 2, lambda action: 1 if action[0] == "F" else 2)
    assert times[("B", 0, 1)] == (7.0, 9.0), f"{RULE}\ngot {times}"


@pytest.mark.parametrize("schedule", [gpipe_table, one_f_one_b_table], ids=["gpipe", "1f1b"])
def test_the_order_of_the_devices_does_not_matter(impl, schedule):
    # Stage s on device p-1-s: the last stage's list comes first.  Same actions, same times.
    seconds = {("F", s): 1.0 + s / 2 for s in range(4)} | {("B", s): 2.0 + s for s in range(4)}
    duration = lambda a: seconds[a[0], a[1]]  # noqa: E731
    table = schedule(4, 6)
    in_order = simulate(impl, table, 4, duration)
    reversed_devices = simulate(impl, table[::-1], 4, duration)
    assert reversed_devices == in_order, (
        "the result does not depend on the order the devices are listed in\nthe same schedule with its devices listed last stage first got different times: "
        "a device may have to wait for one listed after it"
    )


def assert_stuck_with_value_error(simulate_core, table, n_stages, stuck):
    with pytest.raises(ValueError) as raised:
        simulate_core(table, n_stages, by_kind(1.0, 2.0))
        pytest.fail(f"{DEADLOCK}\nsimulate_core({table}, {n_stages}, ...) deadlocks and returned")
    message = str(raised.value)
    assert any(repr(action) in message for action in stuck), (
        f"{DEADLOCK}\nit should name one of {stuck}; it says: {message}"
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
    table = relabeled(table, draw(st.permutations(range(m))))  # micro-batches in any order
    if p > 1 and draw(st.booleans()):
        table = on_fewer_devices(table, p, 2)  # two stages on a device (one on the last, if p is odd)
    actions = [action for row in table for action in row]
    seconds = draw(st.lists(st.integers(0, 8), min_size=len(actions), max_size=len(actions)))
    return table, p, {action: s / 4 for action, s in zip(actions, seconds)}


def by_hand_case(table, n_stages):
    return table, n_stages, {a: 1.0 + a[1] / 2 if a[0] == "F" else 2.0 for row in table for a in row}


@settings(max_examples=60, deadline=None)
@example(by_hand_case(on_fewer_devices(gpipe_table(2, 3), 2, 2), 2))  # two stages on one device
@example(by_hand_case(on_fewer_devices(one_f_one_b_table(4, 4), 4, 2), 4))  # four stages on two devices
@example(by_hand_case(relabeled(one_f_one_b_table(3, 3), [2, 0, 1]), 3))  # micro-batches in another order
@example(by_hand_case(one_f_one_b_table(3, 1), 3))  # m = 1
@given(schedules_with_durations())
def test_each_action_starts_when_its_device_and_inputs_are_ready(impl, case):
    table, p, seconds = case
    times = simulate(impl, table, p, lambda action: seconds[tuple(action)])
    assert_follows_the_rule(times, table, p, seconds)
