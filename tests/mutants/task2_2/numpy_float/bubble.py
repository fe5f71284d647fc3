"""Mutant of Task 2.2: the trace's sums taken with numpy, so the answer is a numpy float.

``np.sum`` and ``np.ptp`` give the right number as an ``np.float64``: a subclass of
float, equal under ==, but not the plain ``float`` promised (its repr,
``np.float64(0.5)``, shows in every printed table).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from solutions.bubble import bubble_fraction_formula  # noqa: F401  (correct)


def bubble_fraction_from_events(events: Sequence[tuple[int, float, float]], n_devices: int) -> float:
    if n_devices < 1 or not events:
        raise ValueError("bad arguments")
    table = np.asarray(events, dtype=float)
    if np.any(table[:, 2] < table[:, 1]) or np.any((table[:, 0] < 0) | (table[:, 0] >= n_devices)):
        raise ValueError("bad event")
    makespan = table[:, 2].max() - table[:, 1].min()
    if makespan == 0:
        return 0.0
    busy = np.sum(table[:, 2] - table[:, 1])
    return 1.0 - busy / (n_devices * makespan)  # BUG: an np.float64
