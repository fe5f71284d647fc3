"""Independent schedule tables and checks of them, shared by the graded tests (tasks 2.1, 2.3, 3.1, 3.2, 5.1-5.3).

Written here, in the tests, so that grading never relies on pipelab's own schedules.
"""

from __future__ import annotations

from contract import assert_type


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


def assert_rows_of_tuples(table, n_devices, function, call):
    """A list of ``n_devices`` rows, each a list of (str, int, int) tuples: the very types,
    so a list ``["F", 0, 1]``, a namedtuple or a numpy int fails (each passes ``==``)."""
    types = f"{function} returns a list of rows, each a list of (str, int, int) tuples"
    assert_type(table, list, types, f"{call}'s result")
    assert len(table) == n_devices, (
        f"{function} returns one row per device\n{call} returned {len(table)} rows"
    )
    for device, row in enumerate(table):
        assert_type(row, list, types, f"{call}: row {device}")
        for action in row:
            assert_type(action, tuple, types, f"{call}: an action of row {device}")
            assert len(action) == 3, f"{types}\n{call}: row {device} holds {action!r}"
            for value, kind in zip(action, (str, int, int)):
                assert_type(value, kind, types, f"{call}: in row {device}, the action {action!r}")


def assert_well_formed(table, n_stages, n_microbatches, function="gpipe_schedule"):
    """One row per device, a list of (str, int, int) tuples; row d runs F and B of every
    micro-batch through stage d, each once."""
    call = f"{function}({n_stages}, {n_microbatches})"
    assert_rows_of_tuples(table, n_stages, function, call)
    for device, row in enumerate(table):
        expected = {(kind, device, mb) for kind in "FB" for mb in range(n_microbatches)}
        actions = [tuple(action) for action in row]
        assert len(actions) == len(set(actions)) == len(expected) and set(actions) == expected, (
            f"device d runs the F and B of every micro-batch through stage d, each once\n"
            f"{call}: device {device} should run F and B of micro-batches 0..{n_microbatches - 1} "
            f"through stage {device}; it runs {actions}"
        )


def assert_table(table, expected, n_stages, n_microbatches, function, clause):
    """The types and actions of a well-formed table, then the very rows of ``expected``."""
    assert_well_formed(table, n_stages, n_microbatches, function)
    assert table == expected, (
        f"{clause}\n{function}({n_stages}, {n_microbatches}) returned\n  {table}\nexpected\n  {expected}"
    )


def assert_new_table_at_each_call(schedule, function, args=(3, 4)):
    """Changing the table one call returned leaves the next call's table as it should be
    (an answer that keeps its tables in a cache, or in a module-level list, fails)."""
    call = f"{function}({', '.join(map(str, args))})"
    first = schedule(*args)
    expected = [list(row) for row in first]
    first[0].append(("F", 0, 99))
    first[1].clear()
    first.append([])
    again = schedule(*args)
    assert again == expected, (
        f"{function} returns a new table at each call (the caller may change it)\n"
        f"after the caller changed the table {call} returned, the next call returned {again}"
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
