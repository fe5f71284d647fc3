"""Task 3.2: peak in-flight micro-batches and peak activation bytes per stage, from a trace (lesson 04)."""

from __future__ import annotations

from collections.abc import Sequence

Event = tuple[int, str, int, float, float]  # (stage, kind, microbatch, start, end), kind "F" or "B"


def peak_inflight(events: Sequence[Event], n_stages: int) -> list[int]:
    """The most micro-batches each stage holds at once during a step.

    ``events`` is a trace: one ``(stage, kind, microbatch, start, end)`` per action that
    ran, kind "F" or "B", in any order.  A micro-batch is *in flight* on stage s from the
    start of its forward F(s, i) to the end of its backward B(s, i): all that time the
    stage keeps what the backward will need.  Intervals are half-open, [start of F, end of
    B): one micro-batch leaving at time t and another entering at the same t are never
    in flight together.  A stage's events may overlap in time (a runtime can start the
    next forward while a backward runs): count intervals, do not assume one action at a
    time.  Return the peak count for each stage 0 .. n_stages - 1 (0 for a stage without
    events), a list of ``int``.  ``events`` may be a list or a tuple; it is left
    unchanged.

    GPipe holds m micro-batches on every stage; 1F1B holds min(p - s, m) on stage s
    (PipeDream-2BW §3.2; DeepSpeed's ``num_pipe_buffers``).  Hint: turn each event into a
    +1 or -1 at one instant and sweep the instants in time order.

    >>> trace = [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 1.0, 2.0),   # micro-batch 0 leaves at 2
    ...          (0, "F", 1, 2.0, 3.0), (0, "B", 1, 3.0, 4.0)]   # micro-batch 1 enters at 2
    >>> peak_inflight(trace, 1)
    [1]

    Raises:
        ValueError: if ``n_stages < 1``, or an event's stage is not one of
            0 .. n_stages - 1.
    """
    _check_events(events, n_stages)
    changes = []  # (time, delta, stage); at equal times -1 sorts before +1
    for stage, kind, _, start, end in events:
        if kind == "F":
            changes.append((start, 1, stage))
        elif kind == "B":
            changes.append((end, -1, stage))
    return _peaks(changes, n_stages)


def peak_activation_bytes(
    events: Sequence[Event], bytes_per_microbatch: Sequence[int], n_stages: int
) -> list[int]:
    """The most activation bytes each stage holds at once during a step.

    Same trace as :func:`peak_inflight`.  Stage s keeps ``bytes_per_microbatch[s]`` bytes
    for micro-batch i from the *end* of F(s, i) (when its activations exist) to the end of
    B(s, i) (when the backward has used them).  As there, a release and an acquisition at
    the same instant do not overlap.  Return the peak bytes for each stage, a list of
    ``int``; ``events`` and ``bytes_per_microbatch`` (lists or tuples) are left unchanged.

    >>> trace = [(0, "F", 0, 0.0, 1.0), (0, "F", 1, 1.0, 2.0),
    ...          (0, "B", 0, 2.0, 3.0), (0, "B", 1, 3.0, 4.0)]
    >>> peak_activation_bytes(trace, [100], 1)
    [200]

    Raises:
        ValueError: as :func:`peak_inflight` (if ``n_stages < 1``, or an event's stage
            is not one of 0 .. n_stages - 1); and if ``len(bytes_per_microbatch)`` is
            not ``n_stages``.
    """
    _check_events(events, n_stages)
    if len(bytes_per_microbatch) != n_stages:
        raise ValueError(
            f"bytes_per_microbatch has {len(bytes_per_microbatch)} entries, one per stage "
            f"is needed ({n_stages})"
        )
    changes = []
    for stage, kind, _, _, end in events:
        if kind == "F":
            changes.append((end, bytes_per_microbatch[stage], stage))
        elif kind == "B":
            changes.append((end, -bytes_per_microbatch[stage], stage))
    return _peaks(changes, n_stages)


def _peaks(changes: list[tuple[float, int, int]], n_stages: int) -> list[int]:
    """Sweep (time, delta, stage) in time order, releases first at equal times."""
    level, peak = [0] * n_stages, [0] * n_stages
    for _, delta, stage in sorted(changes, key=lambda change: (change[0], change[1])):
        level[stage] += delta
        peak[stage] = max(peak[stage], level[stage])
    return peak


def _check_events(events: Sequence[Event], n_stages: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages must be at least 1, got {n_stages}")
    for event in events:
        if not 0 <= event[0] < n_stages:
            raise ValueError(
                f"event {tuple(event)} is on stage {event[0]}, but there are {n_stages} "
                f"stages (0 .. {n_stages - 1})"
            )
