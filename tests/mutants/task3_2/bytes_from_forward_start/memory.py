"""Mutant of Task 3.2: activation bytes counted from the *start* of the forward.

The in-flight rule copied to bytes: the activations only exist once the forward has
computed them, at its end.
"""

from __future__ import annotations

from collections.abc import Sequence

from solutions.memory import _check_events, _peaks, peak_inflight  # noqa: F401

Event = tuple[int, str, int, float, float]


def peak_activation_bytes(
    events: Sequence[Event], bytes_per_microbatch: Sequence[int], n_stages: int
) -> list[int]:
    _check_events(events, n_stages)
    if len(bytes_per_microbatch) != n_stages:
        raise ValueError("one entry per stage")
    changes = []
    for stage, kind, _, start, end in events:
        if kind == "F":
            changes.append((start, bytes_per_microbatch[stage], stage))  # BUG: end
        elif kind == "B":
            changes.append((end, -bytes_per_microbatch[stage], stage))
    return _peaks(changes, n_stages)
