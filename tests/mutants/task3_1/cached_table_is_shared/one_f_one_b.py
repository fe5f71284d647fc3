"""Mutant of Task 3.1: the table kept in a module-level cache and handed out again.

Each call with the same counts returns the very same list: once a caller has changed it
(appended an action, reordered a row to try a variant), every later call is wrong.
"""

from __future__ import annotations

_TABLES: dict[tuple[int, int], list] = {}


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    key = (n_stages, n_microbatches)
    if key not in _TABLES:  # BUG: the cached table itself is returned, not a copy
        schedule = []
        for stage in range(n_stages):
            warmup = min(n_stages - stage - 1, n_microbatches)
            row = [("F", stage, mb) for mb in range(warmup)]
            for k in range(n_microbatches - warmup):
                row += [("F", stage, warmup + k), ("B", stage, k)]
            row += [("B", stage, mb) for mb in range(n_microbatches - warmup, n_microbatches)]
            schedule.append(row)
        _TABLES[key] = schedule
    return _TABLES[key]
