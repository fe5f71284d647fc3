"""`intra_op_threads(n)`: time work on `n` PyTorch intra-op threads, then restore the caller's setting.

On a CPU, PyTorch's default of one thread per core collapses by 10-70x as soon as anything
else uses a core: its threads spin and wait for each other.  Every timed run in pipelab
(the local engine's step, `Costs.from_profile`, `split(method="time")`, the lessons' real
runs) therefore uses one thread by default; `threads=None` keeps the caller's setting.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(n: int | None):
    """Inside the block torch uses `n` intra-op threads (None: leave it as it is)."""
    if check_threads(n) is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_threads(n: int | None) -> int | None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"threads must be a positive int or None, got {n!r}")
    return n
