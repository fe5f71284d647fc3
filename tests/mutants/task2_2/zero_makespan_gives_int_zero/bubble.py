"""Mutant of Task 2.2: ``return 0`` for a step of zero length (and one of one stage).

``0 == 0.0``, so every comparison passes, but the docstring says the answer is 0.0, a
float, like every other answer.
"""

from __future__ import annotations

from collections.abc import Sequence


def bubble_fraction_formula(n_stages: int, n_microbatches: int) -> float:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    if n_stages == 1:
        return 0  # BUG: an int
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


def bubble_fraction_from_events(events: Sequence[tuple[int, float, float]], n_devices: int) -> float:
    if n_devices < 1 or not events:
        raise ValueError("bad arguments")
    for device, start, end in events:
        if end < start or not 0 <= device < n_devices:
            raise ValueError("bad event")
    makespan = max(end for _, _, end in events) - min(start for _, start, _ in events)
    if makespan == 0:
        return 0  # BUG: an int
    busy = sum(end - start for _, start, end in events)
    return 1.0 - busy / (n_devices * makespan)
