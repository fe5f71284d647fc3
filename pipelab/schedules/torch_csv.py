"""Schedules that leave pipelab: PyTorch's compute-only schedule CSV, written and read.

The format is the one `torch.distributed.pipelining` dumps and loads (`PipelineScheduleMulti._dump_csv`
/ `_load_csv`, and `_PipelineScheduleRuntime._load_csv(path, format="compute_only")`, which then
adds the sends and receives itself) and torchtitan's `pipeline_parallel_schedule_csv` option takes:
one row per rank, one cell per action as PyTorch's `_Action` prints it — stage, computation type,
micro-batch — and an empty cell for an idle slot.  pipelab's `Action` prints the same text, so a
device's list is its row:

    0F0,0F1,0I0,0W0,0F2,...      rank 0
    1F0,1I0,1F1,1W0,1I1,...      rank 1

F (forward), B (whole backward), I (input gradient) and W (weight gradient) are the compute types
both sides have.  `to_torch_csv(schedule)` writes a valid schedule's rows (with `aligned=True`,
each action in the column of the unit time step it runs in, idle steps empty, like PyTorch's own
`pipeline_order` dumps); `from_torch_csv(path)` reads any compute-only CSV back through
`from_torch` (so communication cells such as 1SEND_F0 are dropped, and a B on a stage that
elsewhere splits becomes I then W, as there).  Not written: forward-only E actions (PyTorch's
schedules train) and asynchronous PipeDream tables (PyTorch's runtime flushes every step).
"""

from __future__ import annotations

import csv
import io
import os
import re

from ..common.checks import check_counts
from ..common.errors import ScheduleError
from .dependencies import run_dependencies
from .schedule import Schedule
from .torch_tables import from_torch
from .validate import validate

_COMPUTE = re.compile(r"(\d+)(F|I|B|W)(\d+)")  # a compute action inside a cell (also inside an OVERLAP_F_B's parentheses)


def to_torch_csv(schedule: Schedule, path: str | os.PathLike | None = None, *, aligned: bool = False) -> str:
    """The compute-only CSV of `schedule` (validated first): row d is device d's actions, in order.

    Written to `path` when given; the text is returned either way.  `aligned`: put each action in
    the column of the unit time step it runs in (every action one step, as `Schedule.to_text`),
    empty cells for idle steps; PyTorch reads both forms the same (it skips empty cells).
    """
    validate(schedule)
    if schedule.forward_only:
        raise ValueError("PyTorch's schedules train (F with B, or I and W); a forward-only schedule (E actions) has no "
                         "PyTorch CSV form")
    if schedule.asynchronous:
        raise ValueError("an asynchronous PipeDream schedule updates its weights inside the step; PyTorch's runtime "
                         "flushes every step, so it has no PyTorch CSV form")
    if aligned:
        timing = run_dependencies(schedule, duration=lambda action: 1.0)
        rows = [[""] * round(timing.makespan) for _ in schedule.actions]
        for event in timing.events:
            rows[event.device][round(event.start)] = str(event.action)
        rows = [_strip_tail(row) for row in rows]
    else:
        rows = [[str(action) for action in row] for row in schedule.actions]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    text = out.getvalue()
    if path is not None:
        with open(path, "w", newline="") as file:
            file.write(text)
    return text


def from_torch_csv(source: str | os.PathLike | io.TextIOBase, n_microbatches: int | None = None,
                   name: str = "torch csv") -> Schedule:
    """The pipelab Schedule of a PyTorch compute-only CSV: a path, or an open text file (`io.StringIO(text)`).

    Row r is rank r's list.  `n_microbatches` defaults to one more than the largest micro-batch
    named.  The result is not validated: `pl.schedules.validate` names the first problem of a
    table written by hand (a missing W, a backward before its forward, a deadlock).
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, newline="") as file:
            rows = list(csv.reader(file))
    elif hasattr(source, "read"):
        rows = list(csv.reader(io.StringIO(source.read())))
    else:
        raise TypeError(f"from_torch_csv reads a path or an open text file, got {type(source).__name__}")
    rows = [[cell.strip() for cell in row] for row in rows]
    while rows and not any(rows[-1]):  # a trailing empty line
        rows.pop()
    if not rows:
        raise ScheduleError("the CSV has no rows: a PyTorch schedule CSV has one row of actions per rank")
    found = [int(mb) for row in rows for cell in row for _, _, mb in _COMPUTE.findall(cell)]
    if n_microbatches is None:
        if not found:
            raise ScheduleError("the CSV names no compute action (like 0F0): nothing to schedule")
        n_microbatches = max(found) + 1
    check_counts(n_microbatches=n_microbatches)
    return from_torch(dict(enumerate(rows)), n_microbatches, name=name)


def _strip_tail(row: list[str]) -> list[str]:
    while row and not row[-1]:
        row.pop()
    return row

