"""Mutant of Task 3.2: peak_activation_bytes checks only its own argument.

It raises for a bytes_per_microbatch of the wrong length, but not for the errors it
shares with peak_inflight: ``n_stages = 0`` with no events and no bytes returns [], and
an event on stage -1 is counted on the last stage (``bytes[-1]``, ``level[-1]``).
"""

from __future__ import annotations

from collections.abc import Sequence

from solutions.memory import _peaks, peak_inflight  # noqa: F401  (peak_inflight is correct)

Event = tuple[int, str, int, float, float]


def peak_activation_bytes(
    events: Sequence[Event], bytes_per_microbatch: Sequence[int], n_stages: int
) -> list[int]:
    if len(bytes_per_microbatch) != n_stages:  # BUG: n_stages < 1 and the stages of the events unchecked
        raise ValueError("one entry per stage")
    if any(event[0] >= n_stages for event in events):
        raise ValueError("stage out of range")
    changes = []
    for stage, kind, _, _, end in events:
        if kind == "F":
            changes.append((end, bytes_per_microbatch[stage], stage))
        elif kind == "B":
            changes.append((end, -bytes_per_microbatch[stage], stage))
    return _peaks(changes, n_stages)
