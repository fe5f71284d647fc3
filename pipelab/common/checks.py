"""Checks of the counts a caller passes (stages, micro-batches, repeats), with messages that name them."""

from __future__ import annotations


def check_counts(**counts) -> None:
    """Raise a TypeError/ValueError naming any count (n_stages=4, ...) that is not a positive int."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def check_repeats(repeats) -> int:
    """`repeats` of a timed run (a profile, `fastest_step`): a positive int."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int (the fastest run is kept), got {repeats!r}")
    return repeats
