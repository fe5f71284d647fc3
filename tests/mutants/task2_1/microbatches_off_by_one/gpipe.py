"""Mutant of Task 2.1: micro-batches numbered 1 .. m instead of 0 .. m-1."""

from __future__ import annotations


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    microbatches = range(1, n_microbatches + 1)  # BUG: range(n_microbatches)
    return [
        [("F", stage, mb) for mb in microbatches] + [("B", stage, mb) for mb in microbatches]
        for stage in range(n_stages)
    ]
