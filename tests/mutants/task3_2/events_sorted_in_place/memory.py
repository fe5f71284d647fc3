"""Mutant of Task 3.2: the caller's trace sorted in place before the sweep.

``events.sort(key=...)`` by the instant each event counts at: the peaks are right, but
the caller's trace comes back reordered, and a tuple of events raises AttributeError.
"""

from __future__ import annotations

from collections.abc import Sequence

from solutions.memory import _check_events

Event = tuple[int, str, int, float, float]


def _sweep(events, n_stages, held_from_start, weights):
    def instant(event):
        stage, kind, _, start, end = event
        return (start if kind == "F" and held_from_start else end, kind == "F")

    events.sort(key=instant)  # BUG: sorts the caller's list
    level, peak = [0] * n_stages, [0] * n_stages
    for event in events:
        stage, kind = event[0], event[1]
        level[stage] += weights[stage] if kind == "F" else -weights[stage]
        peak[stage] = max(peak[stage], level[stage])
    return peak


def peak_inflight(events: Sequence[Event], n_stages: int) -> list[int]:
    _check_events(events, n_stages)
    return _sweep(events, n_stages, True, [1] * n_stages)


def peak_activation_bytes(
    events: Sequence[Event], bytes_per_microbatch: Sequence[int], n_stages: int
) -> list[int]:
    _check_events(events, n_stages)
    if len(bytes_per_microbatch) != n_stages:
        raise ValueError("one entry per stage")
    return _sweep(events, n_stages, False, bytes_per_microbatch)
