"""Mutant of Task 3.1: a warm-up of min(p - s, m) forwards, one too many.

Still a valid schedule, but stage s holds min(p - s + 1, m) micro-batches, one more than
1F1B needs, and the last stage waits for a forward before its first backward.
"""

from __future__ import annotations


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    schedule = []
    for stage in range(n_stages):
        warmup = min(n_stages - stage, n_microbatches)  # BUG: p - s - 1
        row = [("F", stage, mb) for mb in range(warmup)]
        for k in range(n_microbatches - warmup):
            row += [("F", stage, warmup + k), ("B", stage, k)]
        row += [("B", stage, mb) for mb in range(n_microbatches - warmup, n_microbatches)]
        schedule.append(row)
    return schedule
