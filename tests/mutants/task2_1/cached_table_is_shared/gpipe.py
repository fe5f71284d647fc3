"""Mutant of Task 2.1: tables cached with ``functools.lru_cache`` "for speed".

Every call with the same counts returns the same list object: a caller that appends to
a row (or edits the table to try a variant) changes what every later call returns.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=None)  # BUG: one shared, mutable table per (n_stages, n_microbatches)
def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    return [
        [("F", stage, mb) for mb in range(n_microbatches)]
        + [("B", stage, mb) for mb in range(n_microbatches)]
        for stage in range(n_stages)
    ]
