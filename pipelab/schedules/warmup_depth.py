"""1F1B with a deeper warm-up: more micro-batches in flight, to hide a slow link.

Stage s < p - 1 runs w_s = min(p - s - 1 + extra, m) forwards, then alternates one forward
and one backward, then drains; the last stage keeps w = 0 (its backward needs nothing from
further down).  `extra = 0` is `pl.schedules.one_f_one_b`.  Peak in flight:
min(p - s + extra, m) on stage s < p - 1, 1 on the last.  With free links the makespan is
unchanged, (m + p - 1)(t_F + t_B) for equal stages; with a link latency the extra forwards
give each device work to do while a gradient travels.

Why it helps, and the table at p=4, m=8, extra=2: docs/schedules.md, "1F1B with a deeper
warm-up".
"""

from __future__ import annotations

from ..common.checks import check_counts
from .generators import _one_f_one_b_rows
from .schedule import Schedule


def one_f_one_b_with_warmup(n_stages: int, n_microbatches: int, extra: int) -> Schedule:
    """1F1B whose stages s < p - 1 start `extra` more forwards before their first backward (see the module)."""
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches)
    if isinstance(extra, bool) or not isinstance(extra, int):
        raise TypeError(f"extra must be an int, got {type(extra).__name__} {extra!r}")
    if extra < 0:
        raise ValueError(f"extra is the number of additional warm-up forwards, at least 0, got {extra}")
    warmups = [min(n_stages - s - 1 + extra, n_microbatches) if s < n_stages - 1 else 0 for s in range(n_stages)]
    return Schedule(n_stages, n_microbatches, _one_f_one_b_rows(n_microbatches, warmups),
                    name=f"1f1b+{extra}" if extra else "1f1b")
