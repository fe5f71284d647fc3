"""Mutant of Task 3.1: GPipe's table returned instead (every forward, then every backward).

Same bubble, same actions, valid: only the memory tells them apart (m in flight on every
stage instead of min(p - s, m)).
"""

from __future__ import annotations


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    return [
        [("F", stage, mb) for mb in range(n_microbatches)]
        + [("B", stage, mb) for mb in range(n_microbatches)]
        for stage in range(n_stages)
    ]
