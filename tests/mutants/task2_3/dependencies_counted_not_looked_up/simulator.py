"""Mutant of Task 2.3: a dependency counted as met once enough actions of its kind are done.

"F(s, i) can start when stage s-1 has finished i + 1 forwards": true when every stage
runs its micro-batches in ascending order (as GPipe's and 1F1B's tables do), wrong for a
valid table in another order (backwards last micro-batch first, or micro-batches taken
in another order): it looks up the end of an action that has not run (KeyError), or
calls a table that can finish a deadlock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from solutions.simulator import _dependencies, _waits

Action = tuple[str, int, int]


def simulate_core(
    actions: Sequence[Sequence[Action]], n_stages: int, duration: Callable[[Action], float]
) -> dict[Action, tuple[float, float]]:
    times: dict[Action, tuple[float, float]] = {}
    done = Counter()  # (kind, stage) -> actions finished
    next_index = [0] * len(actions)
    device_free = [0.0] * len(actions)
    remaining = sum(len(row) for row in actions)
    while remaining:
        progressed = False
        for device, row in enumerate(actions):
            while next_index[device] < len(row):
                action = tuple(row[next_index[device]])
                needed = _dependencies(action, n_stages)
                if any(done[kind, stage] <= action[2] for kind, stage, _ in needed):  # BUG: counts
                    break
                start = max([device_free[device]] + [times[need][1] for need in needed])
                end = start + duration(action)
                times[action] = (start, end)
                device_free[device] = end
                done[action[0], action[1]] += 1
                next_index[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("deadlock: " + "; ".join(_waits(actions, next_index, times, n_stages)))
    return times
