"""Independent schedule tables and checks of them, shared by the graded tests (tasks 2.1, 2.3, 3.1, 3.2).

Written here, in the tests, so that grading never relies on pipelab's own schedules.
"""

from __future__ import annotations


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


def assert_well_formed(table, n_stages, n_microbatches, function="gpipe_schedule"):
    call = f"{function}({n_stages}, {n_microbatches})"
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


def gpipe_table(p, m):
    """GPipe written out by hand: all forwards, then all backwards (inputs for tasks 2.3 and 3.2)."""
    return [[("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)] for s in range(p)]


def one_f_one_b_table(p, m):
    """1F1B written out by hand: warm-up min(p-s-1, m) forwards, steady (F, B) pairs, cool-down."""
    table = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        row = [("F", s, i) for i in range(warmup)]
        for k in range(m - warmup):
            row += [("F", s, warmup + k), ("B", s, k)]
        table.append(row + [("B", s, i) for i in range(m - warmup, m)])
    return table
