"""Mutant of Task 2.1: micro-batch indices from ``np.arange``.

The right table, but each action is ``("F", 0, np.int64(3))``: equal to ``("F", 0, 3)``
under ==, and hashed alike, so every comparison passes; yet not the ``int`` promised
(JSON, ``Action.from_str`` and friends reject it).
"""

from __future__ import annotations

import numpy as np


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    microbatches = np.arange(n_microbatches)  # BUG: numpy integers, not int
    return [
        [("F", stage, mb) for mb in microbatches] + [("B", stage, mb) for mb in microbatches]
        for stage in range(n_stages)
    ]
