"""Task 3.1: one_f_one_b_schedule, the 1F1B (PipeDream-Flush) table.

The references are written out here: the drawings of p=4 with m=8 (the docstring's) and
m=2, which a unit-time run of the dependencies (``unit_time_starts`` below) must
reproduce, and small tables.  For every p <= 8 and m <= 16 (m < p included) the table is
checked for its properties: each action once, on its stage's device; the dependencies can
all be met, in GPipe's 2(m + p - 1) unit steps; min(p - s, m) micro-batches in flight on
stage s.
"""

from __future__ import annotations

import pytest

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
    call = f"one_f_one_b_schedule({n_stages}, {n_microbatches})"
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


def test_four_stages_eight_microbatches_as_drawn_in_the_docstring(impl):
    table = impl("one_f_one_b").one_f_one_b_schedule(4, 8)
    assert table == rows_of(P4_M8), f"rows differ from the docstring's drawing: {table}"
    assert draw(table, 4) == P4_M8.strip()


def test_fewer_microbatches_than_stages(impl):
    table = impl("one_f_one_b").one_f_one_b_schedule(4, 2)
    assert table == rows_of(P4_M2), f"rows differ from the drawing of p=4, m=2: {table}"
    assert draw(table, 4) == P4_M2.strip()


def test_two_stages_three_microbatches(impl):
    assert impl("one_f_one_b").one_f_one_b_schedule(2, 3) == [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)],
        [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2)],
    ]


def test_one_stage_alternates_forward_and_backward(impl):
    # No warm-up on the last stage (here the only one): F0 B0 F1 B1 ...
    assert impl("one_f_one_b").one_f_one_b_schedule(1, 3) == [
        [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 0, 2), ("B", 0, 2)]
    ]


def test_every_action_once_on_its_own_stage(impl):
    one_f_one_b_schedule = impl("one_f_one_b").one_f_one_b_schedule
    for n_stages, n_microbatches in GRID:
        assert_well_formed(one_f_one_b_schedule(n_stages, n_microbatches), n_stages, n_microbatches)


def test_dependencies_can_be_met_in_the_fill_drain_time(impl):
    one_f_one_b_schedule = impl("one_f_one_b").one_f_one_b_schedule
    for n_stages, n_microbatches in GRID:
        table = one_f_one_b_schedule(n_stages, n_microbatches)
        steps = max(unit_time_starts(table, n_stages).values()) + 1
        assert steps == 2 * (n_microbatches + n_stages - 1), (
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
            f"one_f_one_b_schedule({n_stages}, {n_microbatches}): micro-batches in flight "
            f"per stage {peaks}, expected min(p - s, m) = {expected} (warm-up of "
            "min(p - s - 1, m) forwards, then one more forward before each backward)"
        )


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(0, 4), (4, 0), (-1, 2)])
def test_invalid_counts_raise_value_error(impl, n_stages, n_microbatches):
    with pytest.raises(ValueError):
        impl("one_f_one_b").one_f_one_b_schedule(n_stages, n_microbatches)
        pytest.fail(f"one_f_one_b_schedule({n_stages}, {n_microbatches}) should raise ValueError")
