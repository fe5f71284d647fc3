"""Independent checks for the tables of tasks 5.1-5.3 (several stages per device, the W kind).

Written here, in the tests, so grading never relies on pipelab's own schedules; the F and B
dependencies, and the 1F1B table these tasks start from, are schedule_tables' own.
"""

from __future__ import annotations

from schedule_tables import inputs_of


def needs(action, n_stages):
    """F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i) (``inputs_of``); W(s, i) needs B(s, i)."""
    kind, stage, mb = action
    return [("B", stage, mb)] if kind == "W" else inputs_of(action, n_stages)


def run(table, n_stages, seconds=lambda action: 1.0):
    """Each device runs its row in order; an action starts when its device is free and every
    action it needs has ended.  {action: (start, end)}; fails on a deadlock."""
    times, position, free = {}, [0] * len(table), [0.0] * len(table)
    moved = True
    while moved:
        moved = False
        for device, row in enumerate(table):
            while position[device] < len(row):
                action = tuple(row[position[device]])
                inputs = needs(action, n_stages)
                if not all(need in times for need in inputs):
                    break
                start = max([free[device]] + [times[need][1] for need in inputs])
                times[action] = (start, start + seconds(action))
                free[device] = start + seconds(action)
                position[device] += 1
                moved = True
    stuck = {d: row[position[d]] for d, row in enumerate(table) if position[d] < len(row)}
    assert not stuck, f"the table deadlocks: these devices wait forever at their next action {stuck}"
    return times


def draw(table, n_stages):
    """One row per device, one column per unit step; a cell names the stage when it is not the row's."""
    times = run(table, n_stages)
    steps = int(max(end for _, end in times.values()))
    grid = [["."] * steps for _ in table]
    for device, row in enumerate(table):
        for kind, stage, mb in row:
            label = f"{kind}{mb}" if stage == device else f"{stage}{kind}{mb}"
            grid[device][int(times[(kind, stage, mb)][0])] = label
    width = max(len(cell) for line in grid for cell in line)
    return "\n".join(f"device {d} | " + " ".join(c.ljust(width) for c in line).rstrip() for d, line in enumerate(grid))


def cells(drawing):
    return [line.split("|", 1)[1].split() for line in drawing.strip().splitlines()]


def peak_held(row, last_kind):
    """Micro-batches a device holds at once: +1 at each F, -1 at each `last_kind` (B, or W), in list order."""
    held = peak = 0
    for kind, _, _ in row:
        held += 1 if kind == "F" else -1 if kind == last_kind else 0
        peak = max(peak, held)
    return peak
