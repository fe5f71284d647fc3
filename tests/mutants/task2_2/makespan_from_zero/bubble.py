"""Mutant of Task 2.2: the makespan measured from t = 0, max(end), not from the first start.

Right whenever the trace starts at 0, wrong for timestamps of a real clock.
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
    makespan = max(end for _, _, end in events)  # BUG: - min(start)
    if makespan == 0:
        return 0.0
    busy = sum(end - start for _, start, end in events)
    return 1.0 - busy / (n_devices * makespan)
