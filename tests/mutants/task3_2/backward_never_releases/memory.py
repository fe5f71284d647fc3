"""Mutant of Task 3.2: a micro-batch enters at its forward and never leaves.

Counts the forwards started so far: right for GPipe (all m forwards run before any
backward), wrong for 1F1B, whose whole point is to free memory at each backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from solutions.memory import _check_events, _peaks

Event = tuple[int, str, int, float, float]


def peak_inflight(events: Sequence[Event], n_stages: int) -> list[int]:
    _check_events(events, n_stages)
    changes = [(start, 1, stage) for stage, kind, _, start, _ in events if kind == "F"]  # BUG: no -1 at B
    return _peaks(changes, n_stages)


def peak_activation_bytes(
    events: Sequence[Event], bytes_per_microbatch: Sequence[int], n_stages: int
) -> list[int]:
    _check_events(events, n_stages)
    if len(bytes_per_microbatch) != n_stages:
        raise ValueError("one entry per stage")
    changes = [  # BUG: no release at the end of B
        (end, bytes_per_microbatch[stage], stage) for stage, kind, _, _, end in events if kind == "F"
    ]
    return _peaks(changes, n_stages)
