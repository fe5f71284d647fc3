"""Mutant of Task 2.2: the makespan read off the first and the last event of the list.

``events[-1][2] - events[0][1]``, as if the trace were sorted by time, which the
docstring does not promise ("in any order").  Right on every trace written in time
order, wrong on one gathered device by device, or shuffled.
"""

from __future__ import annotations

from collections.abc import Sequence

from solutions.bubble import bubble_fraction_formula  # noqa: F401  (correct)


def bubble_fraction_from_events(events: Sequence[tuple[int, float, float]], n_devices: int) -> float:
    if n_devices < 1 or not events:
        raise ValueError("bad arguments")
    for device, start, end in events:
        if end < start or not 0 <= device < n_devices:
            raise ValueError("bad event")
    makespan = events[-1][2] - events[0][1]  # BUG: max(end) - min(start)
    if makespan <= 0:
        return 0.0
    busy = sum(end - start for _, start, end in events)
    return 1.0 - busy / (n_devices * makespan)
