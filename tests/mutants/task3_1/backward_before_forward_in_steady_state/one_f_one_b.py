"""Mutant of Task 3.1: the steady state runs (B, F) pairs instead of (F, B).

The last stage, with no warm-up, then starts with B0 before F0: a deadlock.  Elsewhere a
stage holds one micro-batch fewer than 1F1B allows and the bubble grows.
"""

from __future__ import annotations


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    schedule = []
    for stage in range(n_stages):
        warmup = min(n_stages - stage - 1, n_microbatches)
        row = [("F", stage, mb) for mb in range(warmup)]
        for k in range(n_microbatches - warmup):
            row += [("B", stage, k), ("F", stage, warmup + k)]  # BUG: (F, B) pairs, not (B, F)
        row += [("B", stage, mb) for mb in range(n_microbatches - warmup, n_microbatches)]
        schedule.append(row)
    return schedule
