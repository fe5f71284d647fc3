"""Schedule.grid() (the cells of to_text) and Schedule.message_count()."""

import pytest

import pipelab as pl


def test_grid_is_the_cells_of_to_text():
    grid = pl.schedules.gpipe(4, 4).grid()
    assert len(grid) == 4 and all(len(row) == 2 * (4 + 4 - 1) for row in grid)
    assert [row[0] for row in grid] == ["F0", ".", ".", "."]
    assert [grid[d][2] for d in range(4)] == ["F2", "F1", "F0", "."]  # the text's time step 3 is column 2
    assert sum(row.count(".") for row in grid) == 24
    hand = pl.Schedule.from_text("device 0 | F0 1F0 1B0 B0")
    assert hand.grid() == [["F0", "1F0", "1B0", "B0"]]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (4, 4), (4, 8), (8, 3)])
def test_one_stage_per_device_sends_two_messages_per_boundary_and_micro_batch(name, p, m):
    assert pl.schedules.by_name(name, p, m).message_count() == 2 * m * (p - 1)


def test_neighbouring_stages_on_one_device_send_nothing_between_them():
    # stages 0 and 1 on device 0, stage 2 on device 1: only the 1 <-> 2 boundary crosses devices
    schedule = pl.Schedule(3, 2, [
        [pl.Action("F", 0, 0), pl.Action("F", 1, 0), pl.Action("F", 0, 1), pl.Action("F", 1, 1),
         pl.Action("B", 1, 0), pl.Action("B", 0, 0), pl.Action("B", 1, 1), pl.Action("B", 0, 1)],
        [pl.Action("F", 2, 0), pl.Action("B", 2, 0), pl.Action("F", 2, 1), pl.Action("B", 2, 1)],
    ])
    pl.schedules.validate(schedule)
    assert schedule.message_count() == 2 * 2  # F(2, i) receives, B(1, i) receives, for i = 0, 1
