"""Mutant of Task 3.2: at equal times, entering is counted before leaving.

Intervals become closed, [start of F, end of B]: in 1F1B's steady state a backward ends
exactly when the next forward starts, and that micro-batch is counted twice.
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


def _peaks(changes: list[tuple[float, int, int]], n_stages: int) -> list[int]:
    level, peak = [0] * n_stages, [0] * n_stages
    for _, delta, stage in sorted(changes, key=lambda change: (change[0], -change[1])):  # BUG: +1 first
        level[stage] += delta
        peak[stage] = max(peak[stage], level[stage])
    return peak
