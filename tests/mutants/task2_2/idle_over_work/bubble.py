"""Mutant of Task 2.2: idle time divided by the busy time (the sum of the durations).

(devices x makespan - busy) / busy is the trace's version of (p - 1) / m, the bubble over
the ideal time, not the idle share of the step.
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
    makespan = max(end for _, _, end in events) - min(start for _, start, _ in events)
    busy = sum(end - start for _, start, end in events)
    if makespan == 0:
        return 0.0
    return (n_devices * makespan - busy) / busy  # BUG: divide by n_devices * makespan
