"""Mutant of Task 2.2: counts the devices that appear in the events, not n_devices.

A device that never computed was idle all step, and its idle time goes missing.
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
    if makespan == 0:
        return 0.0
    busy = sum(end - start for _, start, end in events)
    seen = len({device for device, _, _ in events})  # BUG: use n_devices
    return 1.0 - busy / (seen * makespan)
