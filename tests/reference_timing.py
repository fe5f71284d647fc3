"""An independent reference for the dependency loop: the rules and a naive sweep, written out again.

Shared by tests/test_schedules.py (times, deadlocks) and tests/test_validate.py (which
orders can run at all).
"""

from __future__ import annotations

from pipelab.schedules import Action, Schedule


def needs(action: Action, n_stages: int) -> list[Action]:
    """DESIGN.md's dependency rules, written out again (not read from pipelab.schedules.action.NEEDS)."""
    kind, s, i = action
    if kind == "F":
        return [Action("F", s - 1, i)] if s > 0 else []
    if kind == "B":
        return [Action("F", s, i)] + ([Action("B", s + 1, i)] if s + 1 < n_stages else [])
    return [Action("B", s, i)]


def reference_times(schedule: Schedule, duration, delay=lambda a, b: 0.0):
    """Naive fixed point: sweep the devices until nothing more can start. Returns (start, end)."""
    device_of = {a: d for d, row in enumerate(schedule.actions) for a in row}
    start, end = {}, {}
    pos = [0] * len(schedule.actions)
    free = [0.0] * len(schedule.actions)
    progress = True
    while progress:
        progress = False
        for d, row in enumerate(schedule.actions):
            while pos[d] < len(row):
                a = row[pos[d]]
                deps = needs(a, schedule.n_stages)
                if any(x not in end for x in deps):
                    break
                t = free[d]
                for x in deps:
                    t = max(t, end[x] + (delay(x, a) if device_of[x] != d else 0.0))
                start[a], end[a] = t, t + duration(a)
                free[d] = end[a]
                pos[d] += 1
                progress = True
    return start, end
