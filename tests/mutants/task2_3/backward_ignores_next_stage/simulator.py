"""Mutant of Task 2.3: B(s, i) waits only for its own forward F(s, i), not for the
gradient from B(s+1, i).

Every stage then starts its backwards as soon as it is free: the pipeline never drains
and the step looks shorter than it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
            stuck = [row[next_index[d]] for d, row in enumerate(actions) if next_index[d] < len(row)]
            raise ValueError(f"deadlock, stuck at {stuck}")
    return times


def _dependencies(action: Action, n_stages: int) -> list[Action]:
    kind, stage, microbatch = action
    if kind == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    return [("F", stage, microbatch)]  # BUG: and ("B", stage + 1, microbatch) below the last stage
