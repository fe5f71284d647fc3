"""Mutant of Task 2.3: sweeps the devices until every action has run, without checking that
a sweep ran anything (an infinite loop).

Right on every schedule that can finish; on a deadlock it spins forever instead of
raising ValueError.  The graders must stop it with a timeout and say so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from solutions.simulator import _dependencies

Action = tuple[str, int, int]


def simulate_core(
    actions: Sequence[Sequence[Action]], n_stages: int, duration: Callable[[Action], float]
) -> dict[Action, tuple[float, float]]:
    times: dict[Action, tuple[float, float]] = {}
    next_index = [0] * len(actions)
    device_free = [0.0] * len(actions)
    remaining = sum(len(row) for row in actions)
    while remaining:  # BUG: no "did this sweep run anything?" check
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
    return times
