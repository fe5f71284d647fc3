"""Mutant of Task 2.3: each device's list used as a queue, ``row.pop(0)``.

The times are right, but the caller's schedule is emptied by the call (run it twice and
the second run times nothing), and a schedule of tuples raises AttributeError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from solutions.simulator import _dependencies

Action = tuple[str, int, int]


def simulate_core(
    actions: Sequence[Sequence[Action]], n_stages: int, duration: Callable[[Action], float]
) -> dict[Action, tuple[float, float]]:
    times: dict[Action, tuple[float, float]] = {}
    device_free = [0.0] * len(actions)
    while any(actions):
        progressed = False
        for device, row in enumerate(actions):
            while row:
                action = row[0]
                needed = _dependencies(action, n_stages)
                if any(dependency not in times for dependency in needed):
                    break
                row.pop(0)  # BUG: empties the caller's lists
                start = max([device_free[device]] + [times[d][1] for d in needed])
                times[action] = (start, start + duration(action))
                device_free[device] = times[action][1]
                progressed = True
        if not progressed:
            stuck = [row[0] for row in actions if row]
            raise ValueError(f"deadlock at {stuck[0]!r}")
    return times
