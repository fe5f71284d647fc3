"""`schedules.validate`: every kind of broken schedule is caught, with a message naming the action."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelab import schedules
from pipelab.schedules import Action, Schedule
from pipelab.common.errors import PipelineError, ScheduleError
from pipelab.schedules import validate
from reference_timing import reference_times

F = lambda s, i: Action("F", s, i)  # noqa: E731
B = lambda s, i: Action("B", s, i)  # noqa: E731
W = lambda s, i: Action("W", s, i)  # noqa: E731


def without(sched: Schedule, action: Action) -> Schedule:
    return Schedule(sched.n_stages, sched.n_microbatches, [[a for a in row if a != action] for row in sched.actions])


def with_rows(sched: Schedule, rows) -> Schedule:
    return Schedule(sched.n_stages, sched.n_microbatches, rows)


def test_schedule_error_is_a_configuration_error_not_a_failure():
    assert issubclass(ScheduleError, ValueError) and not issubclass(ScheduleError, PipelineError)


# --------------------------------------------------------------------------- valid schedules


def test_valid_hand_written_schedules_pass():
    two_devices = Schedule(2, 2, [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]])
    assert validate(two_devices) is two_devices
    one_device = Schedule(2, 2, [[F(0, 0), F(1, 0), F(0, 1), B(1, 0), F(1, 1), B(0, 0), B(1, 1), B(0, 1)]])
    assert validate(one_device) is one_device
    split_backward = Schedule(2, 1, [[F(0, 0), B(0, 0), W(0, 0)], [F(1, 0), B(1, 0), W(1, 0)]])
    assert validate(split_backward) is split_backward
    # a device with nothing to do is allowed
    idle_device = Schedule(1, 1, [[F(0, 0), B(0, 0)], []])
    assert validate(idle_device) is idle_device


def test_text_schedules_pass_and_fail_as_expected():
    good = Schedule.from_text(
        """
        device 0 | F0 F1 .  .  B0 B1
        device 1 | .  F0 F1 B0 B1
        """
    )
    assert (good.n_stages, good.n_microbatches) == (2, 2)
    validate(good)
    # device 1 starts with micro-batch 1 while device 0 wants micro-batch 0's gradient first
    bad = Schedule.from_text("device 0 | F0 B0 F1 B1\ndevice 1 | F1 F0 B0 B1")
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(bad)
    # one device running both stages, the second stage's forward before the first's
    bad_one_device = Schedule.from_text("device 0 | 1F0 F0 1B0 B0")
    with pytest.raises(ScheduleError, match=r"1F0.*0F0"):
        validate(bad_one_device)


# --------------------------------------------------------------------------- broken entries


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_missing_action_is_named(name):
    sched = schedules.by_name(name, 4, 5)
    for action in [B(2, 3), F(0, 0), F(3, 4), B(0, 4)]:
        with pytest.raises(ScheduleError, match=rf"missing action {action}\b"):
            validate(without(sched, action))


def test_missing_w_on_a_stage_that_splits_its_backward():
    sched = Schedule(2, 1, [[F(0, 0), B(0, 0), W(0, 0)], [F(1, 0), Action("I", 1, 0)]])
    with pytest.raises(ScheduleError, match=r"missing action 1W0 .*stage 1 splits its backward"):
        validate(sched)


def test_b_on_a_stage_with_w_actions_is_its_input_gradient_half():
    """The zero-bubble papers write the input-gradient half B; pipelab reads it as I, so B always means
    the whole backward.  Each stage chooses: stage 0 splits here, stage 1 runs whole backwards."""
    sched = validate(Schedule(2, 1, [[F(0, 0), B(0, 0), W(0, 0)], [F(1, 0), B(1, 0)]]))
    assert [[str(a) for a in row] for row in sched.actions] == [["0F0", "0I0", "0W0"], ["1F0", "1B0"]]
    assert [str(kind) for kind in sched.gradient_kind] == ["I", "B"]


def test_whole_and_split_backwards_on_one_stage_are_refused():
    sched = Schedule(1, 2, [[F(0, 0), B(0, 0), F(0, 1), Action("I", 0, 1)]])
    with pytest.raises(ScheduleError, match=r"stage 0 runs whole backwards \(B\) and split ones \(I, W\)"):
        validate(sched)


def test_duplicated_action_is_named():
    sched = schedules.gpipe(3, 4)
    rows = [list(row) for row in sched.actions]
    rows[1].append(B(1, 2))
    with pytest.raises(ScheduleError, match=r"1B2 .*appears twice"):
        validate(with_rows(sched, rows))


@pytest.mark.parametrize("bad, pattern", [
    (F(3, 0), r"3F0 names stage 3.*3 stages"),
    (B(-1, 0), r"-1B0 names stage -1"),
    (F(0, 4), r"0F4 names micro-batch 4.*4 micro-batches"),
    (B(0, -1), r"0B-1 names micro-batch -1"),
    (("F", 0, 0), r"\('F', 0, 0\) is not an Action"),
    ("0F0", r"'0F0' is not an Action"),
    (None, r"None is not an Action"),
])
def test_bad_entries_are_named_with_their_position(bad, pattern):
    sched = schedules.gpipe(3, 4)
    rows = [list(row) for row in sched.actions]
    rows[2].insert(1, bad)
    with pytest.raises(ScheduleError, match=r"device 2, position 1: .*" + pattern):
        validate(with_rows(sched, rows))


def test_an_unknown_kind_is_refused_when_the_action_is_made():
    with pytest.raises(ScheduleError, match=r"unknown kind 'X'; kinds are F \(forward\), B \(backward\), "
                                            r"I \(input gradient\), W \(weight gradient\)"):
        Action("X", 0, 0)


def test_a_row_that_is_not_a_list_is_named():
    with pytest.raises(ScheduleError, match="device 1's actions must be a list"):
        validate(Schedule(1, 1, [[F(0, 0), B(0, 0)], "F0"]))


def test_stage_split_across_two_devices():
    sched = schedules.gpipe(2, 2)
    rows = [list(row) for row in sched.actions]
    rows[1].remove(B(1, 1))
    rows[0].append(B(1, 1))
    with pytest.raises(ScheduleError, match=r"stage 1's actions are on devices \[0, 1\]"):
        validate(with_rows(sched, rows))


def test_not_a_schedule_and_bad_counts():
    with pytest.raises(TypeError, match="Schedule.*list"):
        validate([[F(0, 0), B(0, 0)]])
    with pytest.raises(ValueError, match="n_stages"):
        validate(Schedule(0, 1, [[]]))
    with pytest.raises(TypeError, match="n_microbatches"):
        validate(Schedule(1, 1.0, [[F(0, 0), B(0, 0)]]))
    with pytest.raises(ScheduleError, match="no devices"):
        validate(Schedule(1, 1, []))


# --------------------------------------------------------------------------- dependencies


def test_backward_before_its_own_forward_on_one_device():
    sched = Schedule(2, 1, [[B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)]])
    # device 0 cannot even start: 0B0 needs 0F0 which comes after it
    with pytest.raises(ScheduleError, match=r"0B0.*needs 0F0.*later in the same list.*own forward"):
        validate(sched)


def test_forward_before_previous_stage_forward_when_both_stages_share_a_device():
    sched = Schedule(2, 1, [[F(1, 0), F(0, 0), B(1, 0), B(0, 0)]])
    with pytest.raises(ScheduleError, match=r"device 0 runs 1F0 .*position 0.*needs 0F0.*position 1.*previous stage"):
        validate(sched)


def test_backward_before_next_stage_backward_when_both_stages_share_a_device():
    sched = Schedule(2, 1, [[F(0, 0), F(1, 0), B(0, 0), B(1, 0)]])
    with pytest.raises(ScheduleError, match=r"device 0 runs 0B0 .*needs 1B0.*next stage"):
        validate(sched)


def test_w_before_its_backward():
    sched = Schedule(1, 1, [[F(0, 0), W(0, 0), B(0, 0)]])
    with pytest.raises(ScheduleError, match=r"0W0 .*needs 0I0.*weight gradient needs its own input gradient"):
        validate(sched)


def test_cross_device_deadlock_names_both_waiting_actions():
    # device 0 waits at 0B0 for 1B0; device 1 waits at 1F1 for 0F1, which device 0 runs after 0B0
    sched = Schedule(2, 2, [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), F(1, 0), B(1, 0), B(1, 1)]])
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(sched)
    message = str(info.value)
    assert re.search(r"device 0 waits at 0B0 for 1B0", message), message
    assert re.search(r"device 1 waits at 1F1 for 0F1", message), message


def test_three_device_deadlock_reports_the_cycle_not_the_bystander():
    # devices 1 and 2 wait on each other; device 0 only waits on device 1
    sched = Schedule(3, 2, [
        [F(0, 0), F(0, 1), B(0, 0), B(0, 1)],
        [F(1, 0), B(1, 0), F(1, 1), B(1, 1)],
        [F(2, 1), F(2, 0), B(2, 0), B(2, 1)],
    ])
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(sched)
    message = str(info.value)
    assert "device 1 waits at 1B0 for 2B0" in message and "device 2 waits at 2F1 for 1F1" in message
    assert "device 0 waits" not in message


@settings(max_examples=80, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 6), name=st.sampled_from(["gpipe", "1f1b"]), data=st.data())
def test_validate_accepts_exactly_the_orders_a_brute_force_check_accepts(p, m, name, data):
    """Shuffle one device's list; validate must agree with a direct feasibility check."""
    sched = schedules.by_name(name, p, m)
    rows = [list(row) for row in sched.actions]
    d = data.draw(st.integers(0, p - 1))
    rows[d] = data.draw(st.permutations(rows[d]))
    shuffled = with_rows(sched, rows)
    assert _feasible(shuffled) == _passes(shuffled)


def _feasible(sched: Schedule) -> bool:
    """Devices run their lists in order; can every action eventually run? (the naive sweep)"""
    _, end = reference_times(sched, duration=lambda a: 1.0)
    return len(end) == sum(map(len, sched.actions))


def _passes(sched: Schedule) -> bool:
    try:
        validate(sched)
    except ScheduleError:
        return False
    return True
