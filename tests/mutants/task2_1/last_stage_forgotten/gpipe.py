"""Mutant of Task 2.1: one row short, the last stage is missing (range(n_stages - 1)).

A one-stage pipeline even comes back empty.
"""

from __future__ import annotations


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    return [
        [("F", stage, mb) for mb in range(n_microbatches)]
        + [("B", stage, mb) for mb in range(n_microbatches)]
        for stage in range(n_stages - 1)  # BUG: range(n_stages)
    ]
