"""Mutant of Task 2.2: the caller's events sorted by start time, in place.

``events.sort(...)`` to find the first start and the last end: the answer is right, but
the caller's trace comes back reordered, and a tuple of events raises AttributeError.
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
    events.sort(key=lambda event: event[1])  # BUG: changes the caller's list
    first_start = events[0][1]
    makespan = max(end for _, _, end in events) - first_start
    if makespan == 0:
        return 0.0
    busy = sum(end - start for _, start, end in events)
    return 1.0 - busy / (n_devices * makespan)
