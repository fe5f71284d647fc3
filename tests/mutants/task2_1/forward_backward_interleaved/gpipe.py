"""Mutant of Task 2.1: each micro-batch's backward right after its forward.

Row s is F0 B0 F1 B1 ...: a valid schedule (the dependencies can be met) but not GPipe:
only one micro-batch is ever in flight and the step takes 2 m p unit steps, not
2 (m + p - 1), since no two stages ever work at once.
"""

from __future__ import annotations


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    schedule = []
    for stage in range(n_stages):
        row = []
        for mb in range(n_microbatches):
            row += [("F", stage, mb), ("B", stage, mb)]  # BUG: backward before the next forward
        schedule.append(row)
    return schedule
