"""Mutant of Task 2.3: devices start free at ``0``, an int, so int durations give int times.

``[0] * n_devices`` instead of ``[0.0] * n_devices``: with durations of 1 and 2 (ints)
every start and end is an int.  ``(0, 1) == (0.0, 1.0)``, so comparisons pass, but the
docstring promises floats (seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from solutions.simulator import _dependencies, _waits

Action = tuple[str, int, int]


def simulate_core(
    actions: Sequence[Sequence[Action]], n_stages: int, duration: Callable[[Action], float]
) -> dict[Action, tuple[float, float]]:
    times: dict[Action, tuple[float, float]] = {}
    next_index = [0] * len(actions)
    device_free = [0] * len(actions)  # BUG: 0, not 0.0
    remaining = sum(len(row) for row in actions)
    while remaining:
        progressed = False
        for device, row in enumerate(actions):
            while next_index[device] < len(row):
                action = row[next_index[device]]
                needed = _dependencies(action, n_stages)
                if any(dependency not in times for dependency in needed):
                    break
                start = max([device_free[device]] + [times[d][1] for d in needed])
                end = start + duration(action)
                times[action] = (start, end)
                device_free[device] = end
                next_index[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("deadlock: " + "; ".join(_waits(actions, next_index, times, n_stages)))
    return times
