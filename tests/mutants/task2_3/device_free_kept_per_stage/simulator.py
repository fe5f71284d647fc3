"""Mutant of Task 2.3: the "free at" time kept per stage, not per device.

Right whenever each device runs one stage (every GPipe and 1F1B table), and even for two
stages on one device with one micro-batch, whose actions all wait on each other anyway.
With several micro-batches, stage 1's forward of micro-batch 0 overlaps stage 0's
forward of micro-batch 1 on the same device.
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
    stage_free = [0.0] * n_stages  # BUG: a device is free once its last action ended, whatever its stage
    remaining = sum(len(row) for row in actions)
    while remaining:
        progressed = False
        for device, row in enumerate(actions):
            while next_index[device] < len(row):
                action = row[next_index[device]]
                needed = _dependencies(action, n_stages)
                if any(dependency not in times for dependency in needed):
                    break
                stage = action[1]
                start = max([stage_free[stage]] + [times[d][1] for d in needed])
                end = start + duration(action)
                times[action] = (start, end)
                stage_free[stage] = end
                next_index[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("deadlock: " + "; ".join(_waits(actions, next_index, times, n_stages)))
    return times
