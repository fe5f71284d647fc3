"""Schedule generators, `Action`/`Schedule` text forms, and the dependency loop (`pipelab.schedules.dependencies`).

Every expectation here comes from somewhere other than the code under test: a closed
form, a count taken by walking the action lists, the drawing in a docstring, or
`reference_times` below, a deliberately naive re-implementation of the timing rule.
"""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelab import schedules
from pipelab.schedules import Action, Schedule
from pipelab.common.errors import ScheduleError
from pipelab.schedules.dependencies import run_dependencies
from reference_timing import needs, reference_times

GENERATORS = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b}
GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]




def peak_by_order(row: list[Action]) -> int:
    """Walk one stage's list: +1 at each F, -1 at each B; the largest running count."""
    held = peak = 0
    for a in row:
        held += 1 if a.kind == "F" else -1 if a.kind == "B" else 0
        peak = max(peak, held)
    return peak


def grid_rows(text: str) -> list[list[str]]:
    return [line.split("|", 1)[1].split() for line in text.splitlines()]


def docstring_grid(func) -> str:
    lines = [line.strip() for line in func.__doc__.splitlines() if line.strip().startswith("device ")]
    assert lines, f"{func.__name__}'s docstring draws no grid"
    return "\n".join(lines)


# --------------------------------------------------------------------------- generators


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_generated_schedule_validates_and_holds_each_action_once(name):
    for p, m in GRID:
        sched = GENERATORS[name](p, m)
        assert schedules.validate(sched) is sched
        assert (sched.n_stages, sched.n_microbatches, sched.n_devices) == (p, m, p)
        expected = sorted(Action(k, s, i) for k in "FB" for s in range(p) for i in range(m))
        assert sorted(sched.all_actions()) == expected, (p, m)
        for s, row in enumerate(sched.actions):  # one stage per device, each on its own row
            assert {a.stage for a in row} == {s}


def test_gpipe_runs_all_forwards_before_any_backward_in_micro_batch_order():
    for p, m in GRID:
        for s, row in enumerate(schedules.gpipe(p, m).actions):
            assert row == [Action("F", s, i) for i in range(m)] + [Action("B", s, i) for i in range(m)]


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_peak_inflight_by_action_order_matches_theory(name):
    for p, m in GRID:
        sched = GENERATORS[name](p, m)
        peaks = [peak_by_order(row) for row in sched.actions]
        theory = [m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)]
        assert peaks == theory, (p, m)


def test_one_f_one_b_warmup_length_and_alternation():
    for p, m in GRID:
        for s, row in enumerate(schedules.one_f_one_b(p, m).actions):
            kinds = "".join(a.kind for a in row)
            warmup = len(kinds) - len(kinds.lstrip("F"))
            # the warm-up is the run of forwards before the first backward, minus the one
            # forward of the first steady-state pair (if there is a steady state)
            expected = min(p - s - 1, m)
            assert warmup == (expected + 1 if expected < m else m), (p, m, s, kinds)
            steady = kinds[expected: expected + 2 * (m - expected)]
            assert steady == "FB" * (m - expected), (p, m, s, kinds)
            assert kinds[expected + 2 * (m - expected):] == "B" * expected
            # forwards and backwards each in micro-batch order
            assert [a.microbatch for a in row if a.kind == "F"] == list(range(m))
            assert [a.microbatch for a in row if a.kind == "B"] == list(range(m))


@pytest.mark.parametrize("func", [schedules.gpipe, schedules.one_f_one_b], ids=["gpipe", "1f1b"])
def test_docstring_drawing_is_what_to_text_draws(func):
    assert func(n_stages=4, n_microbatches=8).to_text() == docstring_grid(func)


def test_to_text_shape_for_a_hand_checked_case():
    assert schedules.gpipe(2, 2).to_text() == (
        "device 0 | F0 F1 .  .  B0 B1\n"
        "device 1 | .  F0 F1 B0 B1 ."  # only trailing spaces are stripped
    )


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_grid_width_is_two_times_m_plus_p_minus_one(name):
    for p, m in GRID:
        sched = GENERATORS[name](p, m)
        assert max(len(cells) for cells in grid_rows(sched.to_text())) == 2 * (m + p - 1), (p, m)
        assert run_dependencies(sched, lambda a: 1.0).makespan == 2 * (m + p - 1)


def test_gpipe_grid_cells_sit_at_their_closed_form_times():
    # unit steps: F(s, i) at s + i;  B(s, i) at (m + p - 1) + (p - 1 - s) + i
    for p, m in GRID:
        rows = grid_rows(schedules.gpipe(p, m).to_text())
        for s in range(p):
            for i in range(m):
                assert rows[s][s + i] == f"F{i}"
                assert rows[s][(m + p - 1) + (p - 1 - s) + i] == f"B{i}"


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_from_text_round_trips_to_text(name):
    for p, m in GRID:
        sched = GENERATORS[name](p, m)
        back = Schedule.from_text(sched.to_text())
        assert back.actions == sched.actions
        assert (back.n_stages, back.n_microbatches) == (p, m)


def test_from_text_round_trips_several_stages_on_one_device():
    row = [Action("F", 0, 0), Action("F", 1, 0), Action("F", 0, 1), Action("F", 1, 1),
           Action("B", 1, 0), Action("B", 0, 0), Action("B", 1, 1), Action("B", 0, 1)]
    sched = Schedule(2, 2, [row])
    text = sched.to_text()
    assert text.split("|")[1].split() == ["F0", "1F0", "F1", "1F1", "1B0", "B0", "1B1", "B1"]
    back = Schedule.from_text(text)
    assert back.actions == [row] and back.n_stages == 2 and back.n_microbatches == 2
    schedules.validate(back)


def test_from_text_errors_are_clear():
    with pytest.raises(ScheduleError, match="no rows"):
        Schedule.from_text("\n\n")
    with pytest.raises(ScheduleError, match="'X3'"):
        Schedule.from_text("device 0 | F0 X3")


# --------------------------------------------------------------------------- names and counts


@pytest.mark.parametrize("name, expected", [("gpipe", "gpipe"), ("GPipe", "gpipe"), ("1f1b", "1f1b"),
                                            ("1F1B", "1f1b"), ("one_f_one_b", "1f1b")])
def test_by_name_accepts_the_names(name, expected):
    sched = schedules.by_name(name, 3, 5)
    assert sched.name == expected
    assert sched.actions == GENERATORS[expected](3, 5).actions


def test_by_name_rejects_unknown_names_listing_the_choices():
    with pytest.raises(ValueError, match=r"unknown schedule 'zigzag'.*gpipe.*1f1b|unknown schedule 'zigzag'.*1f1b.*gpipe"):
        schedules.by_name("zigzag", 2, 2)


def test_by_name_rejects_a_non_string_name_with_a_type_error():
    with pytest.raises(TypeError, match="name"):
        schedules.by_name(1, 2, 2)


@pytest.mark.parametrize("func", [schedules.gpipe, schedules.one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError),
                                        (True, TypeError), ("4", TypeError), (None, TypeError)])
def test_bad_counts_name_the_argument(func, bad, error):
    with pytest.raises(error, match="n_stages"):
        func(bad, 4)
    with pytest.raises(error, match="n_microbatches"):
        func(4, bad)
    with pytest.raises(error, match="n_microbatches"):
        schedules.by_name("gpipe", 2, bad)


# --------------------------------------------------------------------------- Action text


def test_action_text_form():
    assert str(Action("F", 2, 0)) == "2F0"
    assert repr(Action("B", 12, 34)) == "12B34"
    assert Action.from_str("2F0") == Action("F", 2, 0)
    assert Action.from_str(" 3W10 ") == Action("W", 3, 10)
    assert Action.from_str("B7", stage=5) == Action("B", 5, 7)
    assert Action.from_str("1B7", stage=5) == Action("B", 1, 7)  # an explicit stage wins
    assert Action("B", 2, 3).describe() == "B(stage 2, mb 3)"


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from("FBW"), stage=st.integers(0, 999), mb=st.integers(0, 999))
def test_action_str_from_str_round_trip(kind, stage, mb):
    action = Action(kind, stage, mb)
    assert Action.from_str(str(action)) == action
    assert Action.from_str(f"{kind}{mb}", stage=stage) == action


@pytest.mark.parametrize("text", ["", "F", "2X0", "2F", "F0", "-1F0", "2f0", "2F0x", "2 F 0", "F0B1"])
def test_bad_action_strings_raise_schedule_error(text):
    with pytest.raises(ScheduleError, match=re.escape(repr(text))):
        Action.from_str(text)


# --------------------------------------------------------------------------- timing


def test_run_dependencies_agrees_with_the_reference_on_every_grid_schedule():
    for (p, m), name in itertools.product(GRID[::3], GENERATORS):
        sched = GENERATORS[name](p, m)
        dur = lambda a: {"F": 1.0, "B": 2.0}[a.kind] * (1 + a.stage % 3)
        timing = run_dependencies(sched, dur)
        start, end = reference_times(sched, dur)
        assert timing.start == start and timing.end == end and not timing.stuck


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_uniform_makespan_closed_form(name):
    t_f, t_b = 1.0, 2.0
    for p, m in GRID:
        timing = run_dependencies(GENERATORS[name](p, m), lambda a: t_f if a.kind == "F" else t_b)
        assert timing.makespan == (m + p - 1) * (t_f + t_b), (p, m)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(GENERATORS)),
    p=st.integers(1, 6),
    m=st.integers(1, 10),
    data=st.data(),
)
def test_uneven_stages_slowest_stage_bounds_the_makespan(name, p, m, data):
    t_f = data.draw(st.lists(st.integers(1, 9), min_size=p, max_size=p))
    t_b = data.draw(st.lists(st.integers(1, 9), min_size=p, max_size=p))
    dur = lambda a: float(t_f[a.stage] if a.kind == "F" else t_b[a.stage])
    sched = GENERATORS[name](p, m)
    timing = run_dependencies(sched, dur)
    slowest = max(t_f[s] + t_b[s] for s in range(p))
    assert timing.makespan >= m * slowest
    # the first micro-batch's forward and backward chain through every stage
    assert timing.makespan >= sum(t_f) + sum(t_b)
    start, end = reference_times(sched, dur)
    assert timing.start == start and timing.end == end


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(GENERATORS)), p=st.integers(1, 6), m=st.integers(1, 10),
       zero_forward=st.booleans())
def test_order_is_a_topological_order(name, p, m, zero_forward):
    sched = GENERATORS[name](p, m)
    # zero-length forwards put dependent actions at the same start time: ties must still be ordered
    timing = run_dependencies(sched, lambda a: 0.0 if (a.kind == "F" and zero_forward) else 1.0)
    assert sorted(timing.order) == sorted(sched.all_actions())
    index = {a: k for k, a in enumerate(timing.order)}
    for a in timing.order:
        for dep in needs(a, p):
            assert index[dep] < index[a], (a, dep)
    for row in sched.actions:
        assert [index[a] for a in row] == sorted(index[a] for a in row)
    for a in timing.order:
        assert timing.end[a] >= timing.start[a]
        for dep in needs(a, p):
            assert timing.start[a] >= timing.end[dep]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 7), m=st.integers(1, 10), t_f=st.integers(1, 5), t_b=st.integers(1, 5),
       d=st.integers(0, 5))
def test_gpipe_communication_delay_closed_form(p, m, t_f, t_b, d):
    # F(s, i) ends at (s + i + 1) t_F + s d, so the last forward ends at (m + p - 1) t_F + (p - 1) d;
    # the backwards mirror it: B(s, i) ends (i + p - s) t_B + (p - 1 - s) d after that.
    timing = run_dependencies(schedules.gpipe(p, m), lambda a: float(t_f if a.kind == "F" else t_b),
                              links=[float(d)] * (p - 1))
    assert timing.makespan == (m + p - 1) * (t_f + t_b) + 2 * (p - 1) * d


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 7), m=st.integers(1, 10), t_f=st.integers(1, 5), t_b=st.integers(1, 5),
       d=st.integers(0, 5))
def test_one_f_one_b_communication_delay_lengthens_the_critical_path(p, m, t_f, t_b, d):
    dur = lambda a: float(t_f if a.kind == "F" else t_b)
    sched = schedules.one_f_one_b(p, m)
    timing = run_dependencies(sched, dur, links=[float(d)] * (p - 1))
    # micro-batch 0 goes down and back up the pipeline: p forwards, p backwards, 2(p-1) hops
    assert timing.makespan >= p * (t_f + t_b) + 2 * (p - 1) * d
    assert timing.makespan >= (m + p - 1) * (t_f + t_b)
    start, end = reference_times(sched, dur, delay=lambda a, b: float(d))
    assert timing.start == start and timing.end == end


def test_delay_is_only_paid_between_devices():
    # two stages on one device: nothing crosses a link, so the delay changes nothing
    row = [Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)]
    timing = run_dependencies(Schedule(2, 1, [row]), lambda a: 1.0, links=[100.0])
    assert timing.makespan == 4.0


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(GENERATORS)), p=st.integers(2, 6), m=st.integers(1, 8),
       links=st.lists(st.integers(0, 4), min_size=5, max_size=5))
def test_each_link_delays_the_messages_across_its_own_boundary(name, p, m, links):
    # links[b] is paid by F(b) -> F(b+1) and B(b+1) -> B(b) only: compare with the naive sweep
    dur = lambda a: 1.0 if a.kind == "F" else 2.0
    sched = GENERATORS[name](p, m)
    timing = run_dependencies(sched, dur, links=[float(x) for x in links[:p - 1]])
    start, end = reference_times(sched, dur, delay=lambda a, b: float(links[min(a.stage, b.stage)]))
    assert timing.start == start and timing.end == end


def test_durations_per_stage_give_the_same_times_as_a_function():
    sched = schedules.one_f_one_b(4, 6)
    per_stage = {"F": [1.0, 2.0, 3.0, 4.0], "B": [2.0, 1.0, 5.0, 3.0]}
    by_table = run_dependencies(sched, per_stage)
    by_function = run_dependencies(sched, lambda a: per_stage[a.kind][a.stage])
    assert by_table.events == by_function.events


def test_links_must_give_one_time_per_boundary():
    for links in ([1.0, 1.0], [0.0, 0.0]):
        with pytest.raises(ValueError, match="one per boundary"):
            run_dependencies(schedules.gpipe(4, 2), lambda a: 1.0, links=links)


def test_run_dependencies_reports_who_is_stuck():
    sched = Schedule(2, 1, [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]])
    timing = run_dependencies(sched, lambda a: 1.0)
    assert timing.stuck == {0: (Action("B", 0, 0), Action("F", 0, 0)), 1: (Action("F", 1, 0), Action("F", 0, 0))}
    assert timing.order == []


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(GENERATORS)), p=st.integers(1, 5), m=st.integers(1, 5),
       two_per_device=st.booleans(), data=st.data())
def test_shuffled_rows_run_exactly_as_far_as_the_naive_sweep(name, p, m, two_per_device, data):
    # Shuffled lists mostly deadlock, often with several devices waiting on one result:
    # the loop must time the same actions as the sweep and report every device left waiting.
    sched = GENERATORS[name](p, m)
    rows = sched.actions
    if two_per_device and p > 1:  # stages 2d and 2d+1 share device d
        rows = [rows[d] + rows[d + 1] if d + 1 < p else rows[d] for d in range(0, p, 2)]
    rows = [data.draw(st.permutations(row)) for row in rows]
    shuffled = Schedule(p, m, [list(row) for row in rows])
    dur = lambda a: 1.0 if a.kind == "F" else 2.0
    timing = run_dependencies(shuffled, dur)
    start, end = reference_times(shuffled, dur)
    assert timing.start == start and timing.end == end
    unfinished = {d for d, row in enumerate(shuffled.actions) if any(a not in end for a in row)}
    assert set(timing.stuck) == unfinished
    for device, (action, needed) in timing.stuck.items():
        assert action == next(a for a in shuffled.actions[device] if a not in end)
        assert needed not in end and needed in needs(action, p)
