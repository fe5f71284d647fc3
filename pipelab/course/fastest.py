"""The fastest of a few training steps: noise on a shared machine only ever adds time.

Like `timeit`, which reports the best of its runs, a lesson that draws a measured step
takes the one with the shortest makespan: the operating system pausing the process, a
cold cache or another job on the same core can stretch an op, never shrink it.  Bytes
do not depend on timing, so every repeat holds the same activation memory.
"""

from __future__ import annotations

from typing import Any

from ..common.checks import check_repeats
from ..schedules.trace import Trace


def fastest_step(pipe, inputs: Any, targets: Any, repeats: int = 3, warm_up: bool = True) -> Trace:
    """The trace of the shortest of `repeats` steps of `pipe` (a `pl.Pipeline`) on (inputs, targets).

    Runs one untimed step first when `warm_up` (PyTorch's first calls are slow); the
    model's gradients are zeroed before every step, so afterwards `.grad` holds exactly one
    step's gradients, as after a single `pipe.step`.
    """
    check_repeats(repeats)
    if warm_up:
        pipe.model.zero_grad(set_to_none=True)
        pipe.step(inputs, targets)
    traces = []
    for _ in range(repeats):
        pipe.model.zero_grad(set_to_none=True)
        traces.append(pipe.step(inputs, targets).trace)
    return min(traces, key=lambda trace: trace.makespan)
