"""Task 3.1: one_f_one_b_schedule, the 1F1B (PipeDream-Flush) table.

The references are written out here: the drawings of p=4 with m=8 (the docstring's) and
m=2, which a unit-time run of the dependencies (``schedule_tables.unit_time_starts``) must
reproduce, and small tables.  For every p <= 8 and m <= 16 (m < p included) the table is
checked for its properties: each action once, on its stage's device; the dependencies can
all be met, in GPipe's 2(m + p - 1) unit steps; min(p - s, m) micro-batches in flight on
stage s.
"""

from __future__ import annotations

import pytest

from schedule_tables import (
    assert_new_table_at_each_call,
    assert_table,
    assert_well_formed,
    draw,
    peak_inflight_of_row,
    rows_of,
    unit_time_starts,
)

pytestmark = pytest.mark.task3_1

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]

P4_M8 = """
device 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
device 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
device 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
device 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
"""

# Fewer micro-batches than stages: warm-up min(p - s - 1, m) leaves stages 0 and 1 no
# steady state at all.
P4_M2 = """
device 0 | F0 F1 .  .  .  .  .  B0 .  B1
device 1 | .  F0 F1 .  .  .  B0 .  B1 .
device 2 | .  .  F0 F1 .  B0 .  B1 .  .
device 3 | .  .  .  F0 B0 F1 B1 .  .  .
"""


ROWS = "stage s runs min(p - s - 1, m) warm-up forwards, then (F, B) pairs, then the remaining backwards"
FN = "one_f_one_b_schedule"


def test_four_stages_eight_microbatches_as_drawn_in_the_docstring(impl):
    table = impl("one_f_one_b").one_f_one_b_schedule(4, 8)
    assert_table(table, rows_of(P4_M8), 4, 8, FN, f"{ROWS} (the docstring's drawing)")
    assert draw(table, 4) == P4_M8.strip()


def test_fewer_microbatches_than_stages(impl):
    table = impl("one_f_one_b").one_f_one_b_schedule(4, 2)
    assert_table(table, rows_of(P4_M2), 4, 2, FN, f"{ROWS} (m < p: the drawing of p=4, m=2)")
    assert draw(table, 4) == P4_M2.strip()


def test_two_stages_three_microbatches(impl):
    expected = [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)],
        [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2)],
    ]
    assert_table(impl("one_f_one_b").one_f_one_b_schedule(2, 3), expected, 2, 3, FN, ROWS)


def test_one_stage_alternates_forward_and_backward(impl):
    # No warm-up on the last stage (here the only one): F0 B0 F1 B1 ...
    expected = [[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 0, 2), ("B", 0, 2)]]
    assert_table(impl("one_f_one_b").one_f_one_b_schedule(1, 3), expected, 1, 3, FN, ROWS)


def test_one_microbatch_on_three_stages(impl):
    expected = [[("F", s, 0), ("B", s, 0)] for s in range(3)]
    assert_table(impl("one_f_one_b").one_f_one_b_schedule(3, 1), expected, 3, 1, FN, f"{ROWS} (m = 1)")


def test_every_action_once_on_its_own_stage(impl):
    one_f_one_b_schedule = impl("one_f_one_b").one_f_one_b_schedule
    for n_stages, n_microbatches in GRID:
        assert_well_formed(one_f_one_b_schedule(n_stages, n_microbatches), n_stages, n_microbatches,
                           "one_f_one_b_schedule")


def test_dependencies_can_be_met_in_the_fill_drain_time(impl):
    one_f_one_b_schedule = impl("one_f_one_b").one_f_one_b_schedule
    for n_stages, n_microbatches in GRID:
        table = one_f_one_b_schedule(n_stages, n_microbatches)
        steps = max(unit_time_starts(table, n_stages).values()) + 1
        assert steps == 2 * (n_microbatches + n_stages - 1), (
            "with unit-time actions, the 1F1B step lasts GPipe's 2 (m + p - 1) steps\n"
            f"one_f_one_b_schedule({n_stages}, {n_microbatches}) takes {steps} unit steps; "
            f"1F1B has GPipe's bubble, 2 (m + p - 1) = {2 * (n_microbatches + n_stages - 1)} steps"
        )


def test_stage_s_holds_at_most_p_minus_s_microbatches(impl):
    one_f_one_b_schedule = impl("one_f_one_b").one_f_one_b_schedule
    for n_stages, n_microbatches in GRID:
        table = one_f_one_b_schedule(n_stages, n_microbatches)
        peaks = [peak_inflight_of_row(row) for row in table]
        expected = [min(n_stages - stage, n_microbatches) for stage in range(n_stages)]
        assert peaks == expected, (
            "stage s never holds more than min(p - s, m) micro-batches at once\n"
            f"one_f_one_b_schedule({n_stages}, {n_microbatches}): micro-batches in flight "
            f"per stage {peaks}, expected min(p - s, m) = {expected} (warm-up of "
            "min(p - s - 1, m) forwards, then one more forward before each backward)"
        )


def test_a_new_table_at_each_call(impl):
    assert_new_table_at_each_call(impl("one_f_one_b").one_f_one_b_schedule, "one_f_one_b_schedule")


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(0, 4), (4, 0), (-1, 2), (0, 0)])
def test_invalid_counts_raise_value_error(impl, n_stages, n_microbatches):
    with pytest.raises(ValueError):
        impl("one_f_one_b").one_f_one_b_schedule(n_stages, n_microbatches)
        pytest.fail("one_f_one_b_schedule raises ValueError if n_stages < 1 or n_microbatches < 1\n"
                    f"one_f_one_b_schedule({n_stages}, {n_microbatches}) returned without raising")
