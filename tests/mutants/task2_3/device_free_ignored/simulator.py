"""Mutant of Task 2.3: an action with dependencies starts when they end, whether or not its
device is still busy.

``start = max(end of the dependencies)``, falling back on the device's free time only for
actions without dependencies (stage 0's forwards): on stage 1 of GPipe F(1, 1) overlaps
F(1, 0) when stage 1 is the slower one, and B(p-1, 0) overlaps the last stage's forwards.
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
    device_free = [0.0] * len(actions)
    remaining = sum(len(row) for row in actions)
    while remaining:
        progressed = False
        for device, row in enumerate(actions):
            while next_index[device] < len(row):
                action = row[next_index[device]]
                needed = _dependencies(action, n_stages)
                if any(dependency not in times for dependency in needed):
                    break
                # BUG: max(device_free, ...) only when there is no dependency
                start = max((times[d][1] for d in needed), default=device_free[device])
                end = start + duration(action)
                times[action] = (start, end)
                device_free[device] = end
                next_index[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("deadlock: " + "; ".join(_waits(actions, next_index, times, n_stages)))
    return times
