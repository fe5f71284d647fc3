"""Task 2.1: gpipe_schedule, the GPipe table.

The references are written out here: the tables of small cases, and the p=4, m=8 drawing
of the docstring, which a unit-time run of the dependencies (``schedule_tables.unit_time_starts``)
must reproduce.  For every p <= 8 and m <= 16 the table is checked for its properties:
each action once, on its stage's device; the dependencies can all be met; a step of
2(m + p - 1) unit actions; m micro-batches in flight on every stage.
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

pytestmark = pytest.mark.task2_1

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]

P4_M8 = """
device 0 | F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7
device 1 | .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7 .
device 2 | .  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  B0 B1 B2 B3 B4 B5 B6 B7 .  .
device 3 | .  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7 .  .  .
"""


ROWS = "device s runs F(s, 0) .. F(s, m-1), then B(s, 0) .. B(s, m-1)"


def test_two_stages_two_microbatches(impl):
    expected = [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
        [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)],
    ]
    assert_table(impl("gpipe").gpipe_schedule(2, 2), expected, 2, 2, "gpipe_schedule", ROWS)


def test_one_stage_runs_every_forward_then_every_backward(impl):
    expected = [[("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ("B", 0, 1), ("B", 0, 2)]]
    assert_table(impl("gpipe").gpipe_schedule(1, 3), expected, 1, 3, "gpipe_schedule", ROWS)


def test_four_stages_eight_microbatches_as_drawn_in_the_docstring(impl):
    table = impl("gpipe").gpipe_schedule(4, 8)
    assert_table(table, rows_of(P4_M8), 4, 8, "gpipe_schedule", f"{ROWS} (the docstring's drawing)")
    assert draw(table, 4) == draw(rows_of(P4_M8), 4) == P4_M8.strip()


def test_three_stages_one_microbatch(impl):
    expected = [[("F", s, 0), ("B", s, 0)] for s in range(3)]
    assert_table(impl("gpipe").gpipe_schedule(3, 1), expected, 3, 1, "gpipe_schedule", ROWS)


def test_every_action_once_on_its_own_stage(impl):
    gpipe_schedule = impl("gpipe").gpipe_schedule
    for n_stages, n_microbatches in GRID:
        assert_well_formed(gpipe_schedule(n_stages, n_microbatches), n_stages, n_microbatches)


def test_dependencies_can_be_met_in_the_fill_drain_time(impl):
    gpipe_schedule = impl("gpipe").gpipe_schedule
    for n_stages, n_microbatches in GRID:
        table = gpipe_schedule(n_stages, n_microbatches)
        steps = max(unit_time_starts(table, n_stages).values()) + 1
        assert steps == 2 * (n_microbatches + n_stages - 1), (
            "with unit-time actions, the GPipe step lasts 2 (m + p - 1) steps\n"
            f"gpipe_schedule({n_stages}, {n_microbatches}) takes {steps} unit steps, GPipe "
            f"takes {2 * (n_microbatches + n_stages - 1)}"
        )


def test_every_stage_holds_all_microbatches(impl):
    gpipe_schedule = impl("gpipe").gpipe_schedule
    for n_stages, n_microbatches in GRID:
        table = gpipe_schedule(n_stages, n_microbatches)
        peaks = [peak_inflight_of_row(row) for row in table]
        assert peaks == [n_microbatches] * n_stages, (
            "stage s keeps the activations of all m micro-batches at once\n"
            f"gpipe_schedule({n_stages}, {n_microbatches}): micro-batches in flight per "
            f"stage {peaks}; GPipe runs every forward before any backward, so each stage "
            f"holds all {n_microbatches}"
        )


def test_a_new_table_at_each_call(impl):
    assert_new_table_at_each_call(impl("gpipe").gpipe_schedule, "gpipe_schedule")


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(0, 4), (4, 0), (-1, 2), (0, 0)])
def test_invalid_counts_raise_value_error(impl, n_stages, n_microbatches):
    with pytest.raises(ValueError):
        impl("gpipe").gpipe_schedule(n_stages, n_microbatches)
        pytest.fail("gpipe_schedule raises ValueError if n_stages < 1 or n_microbatches < 1\n"
                    f"gpipe_schedule({n_stages}, {n_microbatches}) returned without raising")
