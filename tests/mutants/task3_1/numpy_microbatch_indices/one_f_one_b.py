"""Mutant of Task 3.1: the right 1F1B table, its micro-batch indices numpy integers.

``warmup = np.minimum(p - s - 1, m)`` makes every index computed from it an
``np.int64``: equal to an int under == and in a set, but not the ``int`` promised.
"""

from __future__ import annotations

import numpy as np


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    schedule = []
    for stage in range(n_stages):
        warmup = np.minimum(n_stages - stage - 1, n_microbatches)  # BUG: an np.int64 from here on
        row = [("F", stage, mb) for mb in np.arange(warmup)]
        for k in range(n_microbatches - warmup):
            row += [("F", stage, warmup + k), ("B", stage, k)]
        row += [("B", stage, mb) for mb in np.arange(n_microbatches - warmup, n_microbatches)]
        schedule.append(row)
    return schedule
