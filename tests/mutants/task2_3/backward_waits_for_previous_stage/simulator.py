"""Mutant of Task 2.3: B(s, i) waits for B(s-1, i) instead of B(s+1, i).

The gradient flows from the last stage to the first.  Reversed, stage 0's backwards
start as soon as its forwards are done and the last stage waits for them: the times are
wrong (and a table that lists two stages' backwards on one device, last stage first,
is reported as a deadlock).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from solutions.simulator import _waits

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


def _dependencies(action: Action, n_stages: int) -> list[Action]:
    kind, stage, microbatch = action
    if kind == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if stage > 0:  # BUG: the gradient comes from stage + 1, below the last stage
        return [("F", stage, microbatch), ("B", stage - 1, microbatch)]
    return [("F", stage, microbatch)]
