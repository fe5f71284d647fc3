"""Mutant of Task 2.1: each row a tuple of actions instead of a list.

The right actions in the right order, but ``(("F", 0, 0), ...)`` is not the list the
docstring promises: ``row.append`` fails, and it never equals the list of a table.
"""

from __future__ import annotations


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    return [
        tuple([("F", stage, mb) for mb in range(n_microbatches)]  # BUG: a tuple, not a list
              + [("B", stage, mb) for mb in range(n_microbatches)])
        for stage in range(n_stages)
    ]
