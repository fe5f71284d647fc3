"""PyTorch's own schedule tables (`torch.distributed.pipelining`) as pipelab Schedules.

`torch_table` builds a PyTorch schedule class's `pipeline_order` ({rank: [an `_Action` or
None per time step]}) without a process group, and `from_torch` turns it into a pipelab
Schedule, which `validate`, `simulate`, `to_text` and the engines take like any other:

    order = pl.schedules.torch_table("InterleavedZeroBubble", n_devices=4, n_microbatches=8, n_chunks=2)
    sched = pl.schedules.from_torch(order, n_microbatches=8)
    pl.schedules.validate(sched)

F, I, W and B keep their letters (a B on a stage that elsewhere splits its backward becomes
I then W); communication and bookkeeping actions and the idle slots are dropped.  Details
(mock stages, OVERLAP_F_B, what is dropped and why): docs/schedules.md, "PyTorch's tables".
"""

from __future__ import annotations

import logging
from typing import Mapping

from ..common.checks import check_counts
from ..common.errors import ScheduleError
from .action import Action
from .schedule import Schedule

TORCH_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
               "DualPipeV")
"""The schedule classes `torch_table` builds (torch.distributed.pipelining.schedules.get_schedule_class)."""

_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2p - 1 - r
_KIND = {"F": "F", "I": "I", "W": "W", "B": "B"}


class _MockStage:
    """What a PyTorch schedule constructor reads from its stages, and nothing else (no model, no group)."""

    def __init__(self, stage_index: int, n_stages: int, n_devices: int, rank: int):
        self.stage_index, self.num_stages = stage_index, n_stages
        self.group_size, self.group_rank = n_devices, rank
        self.is_first, self.is_last = stage_index == 0, stage_index == n_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def torch_table(name: str, n_devices: int, n_microbatches: int, n_chunks: int | None = None) -> dict[int, list]:
    """PyTorch's `pipeline_order` for its schedule `name` ("GPipe", "1F1B", "Interleaved1F1B", ...).

    `n_chunks` (stages per rank) is 1 for GPipe and 1F1B, 2 for ZBVZeroBubble and
    DualPipeV, and defaults to 2 for the other multi-stage schedules.  The table is
    PyTorch's, unchanged: it may be wrong (see `from_torch` and `validate`).
    """
    from torch.distributed.pipelining import schedules as torch_schedules

    check_counts(n_devices=n_devices, n_microbatches=n_microbatches)
    if not isinstance(name, str):
        raise TypeError(f"name must be a PyTorch schedule name like '1F1B', got {type(name).__name__}")
    try:
        cls = torch_schedules.get_schedule_class(name)
    except ValueError as error:
        raise ValueError(f"unknown PyTorch schedule {name!r}; pipelab builds {list(TORCH_NAMES)}") from error
    canonical = next((n for n in TORCH_NAMES if n.lower() == name.lower()), None)
    if canonical is None:
        raise ValueError(f"pipelab does not build PyTorch's {name!r} table; it builds {list(TORCH_NAMES)}")
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    default = 1 if single else 2
    chunks = default if n_chunks is None else n_chunks
    check_counts(n_chunks=chunks)
    if single and chunks != 1:
        raise ValueError(f"PyTorch's {canonical} runs one stage per rank; n_chunks must be 1, got {chunks}")
    if canonical in _V_SHAPED and chunks != 2:
        raise ValueError(f"PyTorch's {canonical} runs exactly two stages per rank; n_chunks must be 2, got {chunks}")
    n_stages = n_devices * chunks
    quiet = logging.getLogger("torch.distributed.pipelining.schedules")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        if single:
            schedule = cls(_MockStage(0, n_stages, n_devices, 0), n_microbatches)
        else:
            indices = [0, n_stages - 1] if canonical in _V_SHAPED else [k * n_devices for k in range(chunks)]
            schedule = cls([_MockStage(i, n_stages, n_devices, 0) for i in indices], n_microbatches)
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"PyTorch's {canonical} refused p={n_devices}, m={n_microbatches}, "
                         f"n_chunks={chunks}: {error}") from error
    finally:
        quiet.level = level
    return {rank: list(row) for rank, row in schedule.pipeline_order.items()}


def from_torch(pipeline_order: Mapping[int, list], n_microbatches: int, name: str = "torch") -> Schedule:
    """The pipelab Schedule of a PyTorch `pipeline_order` ({rank: [_Action, "2F0" or None, ...]}).

    Translation in the module docstring.  The result is not validated: call
    `pl.schedules.validate` on it, which names the first wrong entry (PyTorch 2.13's
    Schedule1F1B table, for one, gives its last rank F1 .. Fm instead of F0 .. Fm-1).
    """
    from torch.distributed.pipelining.schedules import _Action

    check_counts(n_microbatches=n_microbatches)
    if not isinstance(pipeline_order, Mapping) or not pipeline_order:
        raise TypeError("pipeline_order must be a non-empty dict {rank: [actions]}, as PyTorch's schedules hold it")
    keys = list(pipeline_order)
    if not all(type(rank) is int for rank in keys):
        odd = next(rank for rank in keys if type(rank) is not int)
        raise TypeError(f"pipeline_order's keys are ranks (ints), got {odd!r}")
    ranks = sorted(keys)
    if ranks != list(range(len(ranks))):
        raise ScheduleError(f"pipeline_order's ranks must be 0..{len(ranks) - 1}, got {ranks}")
    rows: list[list[tuple[str, int, int, str]]] = []  # (kind, stage, micro-batch, PyTorch's kind)
    for rank in ranks:
        entries = pipeline_order[rank]
        if not isinstance(entries, (list, tuple)):
            raise TypeError(f"rank {rank}'s row of pipeline_order must be a list of actions, got "
                            f"{type(entries).__name__} {entries!r}")
        row = []
        for position, entry in enumerate(entries):
            for part in _parts(entry, f"rank {rank}, position {position}", _Action):
                kind = _KIND.get(part.computation_type.value)
                if kind is None:  # communication or bookkeeping
                    continue
                if part.microbatch_index is None:
                    raise ScheduleError(f"rank {rank}, position {position}: {part} names no micro-batch")
                row.append((kind, part.stage_index, part.microbatch_index, part.computation_type.value))
        rows.append(row)
    split = {stage for row in rows for kind, stage, _, _ in row if kind == "W"}
    actions = []
    for row in rows:
        out = []
        for kind, stage, mb, _ in row:
            if kind == "B" and stage in split:  # a full backward on a splitting stage: its two halves, back to back
                out += [Action("I", stage, mb), Action("W", stage, mb)]
            else:
                out.append(Action(kind, stage, mb))
        actions.append(out)
    n_stages = 1 + max((a.stage for row in actions for a in row), default=0)
    return Schedule(n_stages, n_microbatches, actions, name=name)


def _parts(entry, where: str, action_type) -> tuple:
    """The PyTorch actions of one entry of a row: none for an idle slot (None or ""), its sub-actions for an
    OVERLAP_F_B, else itself; an entry that is none of PyTorch's forms is named (`where`)."""
    if isinstance(entry, str):
        try:
            entry = action_type.from_str(entry)
        except (ValueError, RuntimeError, KeyError, AttributeError) as error:
            raise ScheduleError(f"{where}: cannot read {entry!r} as a PyTorch action (like '2F0' or '1B3'): "
                                f"{error}") from None
    if entry is None:
        return ()
    if not isinstance(entry, action_type):
        raise TypeError(f"{where}: {entry!r} ({type(entry).__name__}) is not a PyTorch action: an entry is an "
                        "_Action, its text like '2F0', or None for an idle slot")
    parts = entry.sub_actions or (entry,)
    for part in parts:
        if not isinstance(part, action_type) or not hasattr(part.computation_type, "value"):
            raise TypeError(f"{where}: {part!r} in {entry!r} is not a PyTorch action")
        if type(part.stage_index) is not int or (part.microbatch_index is not None
                                                 and type(part.microbatch_index) is not int):
            raise ScheduleError(f"{where}: {part!r} must name its stage and micro-batch with ints, got "
                                f"{part.stage_index!r} and {part.microbatch_index!r}")
    return parts


def torch_schedule(name: str, n_devices: int, n_microbatches: int, n_chunks: int | None = None) -> Schedule:
    """`from_torch(torch_table(...))`, named "torch <name>" (not validated)."""
    order = torch_table(name, n_devices, n_microbatches, n_chunks)
    return from_torch(order, n_microbatches, name=f"torch {name}")

