"""Task 2.1: gpipe_schedule, the GPipe table.

The references are written out here: the tables of small cases, and the p=4, m=8 drawing
of the docstring, which a unit-time run of the dependencies (``unit_time_starts`` below)
must reproduce.  For every p <= 8 and m <= 16 the table is checked for its properties:
each action once, on its stage's device; the dependencies can all be met; a step of
2(m + p - 1) unit actions; m micro-batches in flight on every stage.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.task2_1

GRID = [(p, m) for p in range(1, 9) for m in range(1, 17)]

P4_M8 = """
device 0 | F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7
device 1 | .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7 .
device 2 | .  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  B0 B1 B2 B3 B4 B5 B6 B7 .  .
device 3 | .  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7 .  .  .
"""


def rows_of(drawing: str) -> list[list[tuple[str, int, int]]]:
    """The table a drawing shows: on row d, cell 'F3' is ('F', d, 3); '.' is idle."""
    rows = []
    for device, line in enumerate(drawing.strip().splitlines()):
        cells = line.split("|")[1].split()
        rows.append([(cell[0], device, int(cell[1:])) for cell in cells if cell != "."])
    return rows


def inputs_of(action, n_stages):
    """F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i)."""
    kind, stage, mb = action
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < n_stages - 1 else [])


def unit_time_starts(table, n_stages) -> dict:
    """Run the table with every action one step long, each as soon as its device is free
    and its inputs are ready: {action: start step}.  Fails on a deadlock."""
    start, position, free = {}, [0] * len(table), [0] * len(table)
    moved = True
    while moved:
        moved = False
        for device, row in enumerate(table):
            while position[device] < len(row):
                action = tuple(row[position[device]])
                needs = inputs_of(action, n_stages)
                if not all(need in start for need in needs):
                    break
                start[action] = max([free[device]] + [start[need] + 1 for need in needs])
                free[device] = start[action] + 1
                position[device] += 1
                moved = True
    stuck = {d: row[position[d]] for d, row in enumerate(table) if position[d] < len(row)}
    assert not stuck, (
        f"the table deadlocks: these devices wait forever at their next action {stuck} "
        "(F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i))"
    )
    return start


def draw(table, n_stages) -> str:
    """The drawing of the docstring: one row per device, one column per time step."""
    start = unit_time_starts(table, n_stages)
    steps = max(start.values()) + 1
    lines = []
    for device, row in enumerate(table):
        cells = [". "] * steps
        for kind, _, mb in row:
            cells[start[(kind, device, mb)]] = f"{kind}{mb}"
        lines.append(f"device {device} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def assert_well_formed(table, n_stages, n_microbatches):
    call = f"gpipe_schedule({n_stages}, {n_microbatches})"
    assert isinstance(table, list) and len(table) == n_stages, (
        f"{call} should return a list of {n_stages} rows (one per device), got "
        f"{len(table) if isinstance(table, list) else type(table).__name__}"
    )
    for device, row in enumerate(table):
        expected = {(kind, device, mb) for kind in "FB" for mb in range(n_microbatches)}
        actions = [tuple(action) for action in row]
        assert len(actions) == len(set(actions)) == len(expected) and set(actions) == expected, (
            f"{call}: device {device} should run F and B of micro-batches 0..{n_microbatches - 1} "
            f"through stage {device}, each once; it runs {actions}"
        )


def peak_inflight_of_row(row) -> int:
    """Micro-batches a device holds at once: +1 at each F, -1 at each B, in list order."""
    held = peak = 0
    for kind, _, _ in row:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def test_two_stages_two_microbatches(impl):
    assert impl("gpipe").gpipe_schedule(2, 2) == [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
        [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)],
    ]


def test_one_stage_runs_every_forward_then_every_backward(impl):
    assert impl("gpipe").gpipe_schedule(1, 3) == [
        [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ("B", 0, 1), ("B", 0, 2)]
    ]


def test_four_stages_eight_microbatches_as_drawn_in_the_docstring(impl):
    table = impl("gpipe").gpipe_schedule(4, 8)
    assert table == rows_of(P4_M8), f"rows differ from the docstring's drawing: {table}"
    assert draw(table, 4) == draw(rows_of(P4_M8), 4) == P4_M8.strip()


def test_three_stages_one_microbatch(impl):
    assert impl("gpipe").gpipe_schedule(3, 1) == [
        [("F", 0, 0), ("B", 0, 0)],
        [("F", 1, 0), ("B", 1, 0)],
        [("F", 2, 0), ("B", 2, 0)],
    ]


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
            f"gpipe_schedule({n_stages}, {n_microbatches}) takes {steps} unit steps, GPipe "
            f"takes 2 (m + p - 1) = {2 * (n_microbatches + n_stages - 1)}"
        )


def test_every_stage_holds_all_microbatches(impl):
    gpipe_schedule = impl("gpipe").gpipe_schedule
    for n_stages, n_microbatches in GRID:
        table = gpipe_schedule(n_stages, n_microbatches)
        peaks = [peak_inflight_of_row(row) for row in table]
        assert peaks == [n_microbatches] * n_stages, (
            f"gpipe_schedule({n_stages}, {n_microbatches}): micro-batches in flight per "
            f"stage {peaks}; GPipe runs every forward before any backward, so each stage "
            f"holds all {n_microbatches}"
        )


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(0, 4), (4, 0), (-1, 2)])
def test_invalid_counts_raise_value_error(impl, n_stages, n_microbatches):
    with pytest.raises(ValueError):
        impl("gpipe").gpipe_schedule(n_stages, n_microbatches)
        pytest.fail(f"gpipe_schedule({n_stages}, {n_microbatches}) should raise ValueError")
