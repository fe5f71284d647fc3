"""Mutant of Task 3.2: a micro-batch counted in flight from the *end* of its forward.

The same as the right answer whenever a stage runs one action at a time; it misses a
forward that starts while another micro-batch's backward still runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from solutions.memory import _check_events, _peaks, peak_activation_bytes  # noqa: F401

Event = tuple[int, str, int, float, float]


def peak_inflight(events: Sequence[Event], n_stages: int) -> list[int]:
    _check_events(events, n_stages)
    changes = []
    for stage, kind, _, start, end in events:
        if kind == "F":
            changes.append((end, 1, stage))  # BUG: start
        elif kind == "B":
            changes.append((end, -1, stage))
    return _peaks(changes, n_stages)
