"""Mutant of Task 3.2: levels start at 0.0, so the peaks come back as floats.

``[0.0] * n_stages`` for the running totals: ``[200.0] == [200]``, so comparisons pass,
but the docstring promises a list of int (byte counts and micro-batch counts).
"""

from __future__ import annotations

from collections.abc import Sequence

from solutions.memory import _check_events

Event = tuple[int, str, int, float, float]


def peak_inflight(events: Sequence[Event], n_stages: int) -> list[int]:
    _check_events(events, n_stages)
    changes = []
    for stage, kind, _, start, end in events:
        if kind == "F":
            changes.append((start, 1, stage))
        elif kind == "B":
            changes.append((end, -1, stage))
    return _peaks(changes, n_stages)


def peak_activation_bytes(
    events: Sequence[Event], bytes_per_microbatch: Sequence[int], n_stages: int
) -> list[int]:
    _check_events(events, n_stages)
    if len(bytes_per_microbatch) != n_stages:
        raise ValueError("one entry per stage")
    changes = []
    for stage, kind, _, _, end in events:
        if kind == "F":
            changes.append((end, bytes_per_microbatch[stage], stage))
        elif kind == "B":
            changes.append((end, -bytes_per_microbatch[stage], stage))
    return _peaks(changes, n_stages)


def _peaks(changes, n_stages):
    level, peak = [0.0] * n_stages, [0.0] * n_stages  # BUG: floats
    for _, delta, stage in sorted(changes, key=lambda change: (change[0], change[1])):
        level[stage] += delta
        peak[stage] = max(peak[stage], level[stage])
    return peak
