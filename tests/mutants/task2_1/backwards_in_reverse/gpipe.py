"""Mutant of Task 2.1: the backwards in reverse micro-batch order, B(m-1) .. B(0).

Valid and just as fast (the last forward's backward can start at once), but not the
table asked for: pipelab's GPipe, and the docstring's drawing, run B0 first.
"""

from __future__ import annotations


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    return [
        [("F", stage, mb) for mb in range(n_microbatches)]
        + [("B", stage, mb) for mb in reversed(range(n_microbatches))]  # BUG: reversed
        for stage in range(n_stages)
    ]
