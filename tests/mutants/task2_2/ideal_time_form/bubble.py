"""Mutant of Task 2.2: the bubble relative to the ideal time, (p - 1) / m.

Megatron-LM SC21 writes the bubble that way too, but it is not the share of the step:
p=4, m=8 gives 3/8 instead of 3/11.
"""

from __future__ import annotations

from solutions.bubble import bubble_fraction_from_events  # noqa: F401  (correct)


def bubble_fraction_formula(n_stages: int, n_microbatches: int) -> float:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    return (n_stages - 1) / n_microbatches  # BUG: / (m + p - 1)
