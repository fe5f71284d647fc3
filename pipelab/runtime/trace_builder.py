"""One Trace from per-action rows, whichever placement ran the step.

Each process records one row per action it ran (`COLUMNS`: its start and end in host seconds,
its wait for a message and when its result was sent, the bytes it counted, the loss, the
memory observer's own seconds inside it, the CUDA allocator's readings; NaN where a value does
not apply).  The distributed placement exchanges the rows so that every rank has all of them
(`runtime/exchange.py`); the local one has them all already.  `build_trace` turns the rows
into the step's `Trace`:

- "measured": the rows' own times, from the first start (one CUDA device per stage, or one
  process per rank, its clock put on rank 0's);
- "replayed": each action's measured duration (less the observer's own time) on one virtual
  clock per device, with the schedule's dependencies (`run_dependencies`): stages that share a
  device, as all of them on one CPU, could not run at once for real.

The "counted" memory follows the rule of `predict/memory.py` from the rows' bytes, the
"observed" memory comes from the placement (`place_observed`), and on CUDA the allocator's
readings become "allocated" and "allocated_peak" samples.
"""

from __future__ import annotations

import math
from typing import Callable

from ..predict.memory import activation_samples
from ..schedules.action import GRADIENT_KINDS, HOLDING_KINDS, NARROWING_KINDS, PROFILES, Action, Kind, goes_forward
from ..schedules.dependencies import run_dependencies
from ..schedules.routes import Routes
from ..schedules.schedule import Schedule
from ..schedules.trace import Event, MemorySample, Message, Trace, Wait
from .memory_observer import observed_breakdown, observed_samples

COLUMNS = ("start", "end", "wait_start", "wait_end", "sent", "saved_bytes", "recomputed_bytes", "for_w_bytes", "loss",
           "observer_seconds", "allocated", "allocated_peak")
START, END, WAIT_START, WAIT_END, SENT, SAVED, RECOMPUTED, FOR_W, LOSS, OWN, ALLOCATED, PEAK = range(len(COLUMNS))
NAN = math.nan

PlaceObserved = Callable[[dict, dict, float], list[tuple]]
"""(start, end of every action on the trace's axis, the origin in host seconds) -> the observed memory changes
as (trace time, device, delta, reason)."""


def action_row(action: Action, worker, times: tuple[float, ...], readings: tuple[float, float, float] = (0.0, NAN, NAN),
               offset: float = 0.0) -> list[float]:
    """One action's row (`COLUMNS`): `times` are its (start, end[, wait_start, wait_end, sent]) in host seconds,
    moved by `offset` (a rank's clock onto rank 0's); `readings` the observer's own seconds inside it and the
    CUDA allocator's readings after and during it."""
    kind, i = action.kind, action.microbatch
    start, end, wait_start, wait_end, sent = (*times, NAN, NAN, NAN)[:5]
    loss = worker.losses.get(i) if goes_forward(kind) and worker.is_last else None
    return [start + offset, end + offset, wait_start + offset, wait_end + offset, sent + offset,
            worker.saved_bytes[i] if kind in HOLDING_KINDS else NAN,
            worker.recomputed_bytes.get(i, 0) if kind in GRADIENT_KINDS else NAN,
            worker.for_w_bytes[i] if kind in NARROWING_KINDS else NAN,
            NAN if loss is None else float(loss), *readings]


def readings(action: Action, clock, observer) -> tuple[float, float, float]:
    """The observer's own seconds inside `action` (None: not counted), and the allocator's readings (NaN on a
    CPU)."""
    own = 0.0 if observer is None else observer.own.get(action, 0.0)
    return own, clock.allocated.get(action, NAN), clock.allocated_peak.get(action, NAN)


def losses(schedule: Schedule, rows: dict[Action, list[float]]) -> list[float]:
    """The last stage's micro-batch losses, from its forwards' rows (F, or E when evaluating)."""
    last = schedule.n_stages - 1
    forward = PROFILES[schedule.profiles[last]][0]
    return [rows[Action(forward, last, i)][LOSS] for i in range(schedule.n_microbatches)]


def durations(rows: dict[Action, list[float]], replayed: bool) -> dict[Action, float]:
    """Each action's seconds as the trace has them: measured, less the observer's own time when replayed."""
    return {a: row[END] - row[START] - (row[OWN] if replayed else 0.0) for a, row in rows.items()}


def build_trace(schedule: Schedule, rows: dict[Action, list[float]], place_observed: PlaceObserved, *,
                replayed: bool, device_names: list[str], n_processes: int = 1) -> Trace:
    """The step's Trace from every action's row (module docstring)."""
    device_of_stage = schedule.device_of_stage()
    seconds = durations(rows, replayed)
    if replayed:
        timing = run_dependencies(schedule, duration=seconds.__getitem__)
        start, end, origin = timing.start, timing.end, 0.0
    else:
        origin = min(row[START] for row in rows.values())
        start = {a: row[START] - origin for a, row in rows.items()}
        end = {a: row[END] - origin for a, row in rows.items()}
    events = sorted((Event(a.kind, a.stage, a.microbatch, start[a], end[a], device_of_stage[a.stage]) for a in rows),
                    key=lambda e: (e.start, e.device))
    waits, messages = _waits_and_messages(schedule, rows, origin, device_of_stage)
    gradient_kind = schedule.gradient_kind
    memory = activation_samples(events, lambda s, i: rows[Action(Kind.F, s, i)][SAVED],
                                lambda s, i: rows[Action(gradient_kind[s], s, i)][RECOMPUTED], schedule.n_devices,
                                lambda s, i: rows[Action(Kind.I, s, i)][FOR_W])
    placed = place_observed(start, end, origin)
    memory += observed_samples(placed, schedule.n_devices)
    for event in events:
        row = rows[event.action]
        if not math.isnan(row[ALLOCATED]):
            memory.append(MemorySample(event.device, event.end, int(row[ALLOCATED]), "allocated"))
            memory.append(MemorySample(event.device, event.start, int(row[PEAK]), "allocated_peak"))
    return Trace(events, memory, "replayed" if replayed else "measured", schedule.n_stages, schedule.n_microbatches,
                 schedule.n_devices, schedule.name, device_names, waits, messages, n_processes=n_processes,
                 observed_peak_parts=observed_breakdown(placed, schedule.n_devices))


def _waits_and_messages(schedule: Schedule, rows: dict[Action, list[float]], origin: float,
                        device_of_stage: dict[int, int]) -> tuple[list[Wait], list[Message]]:
    """A device's wait for a message, and the message itself (sent by its producer), where the rows have one."""
    waits, messages, routes = [], [], None
    for action, row in rows.items():
        if math.isnan(row[WAIT_START]):
            continue
        routes = routes or Routes(schedule)
        device = device_of_stage[action.stage]
        waits.append(Wait(device, row[WAIT_START] - origin, row[WAIT_END] - origin, action))
        source = routes.producer(action)
        messages.append(Message(device_of_stage[source.stage], device, rows[source][SENT] - origin,
                                row[WAIT_END] - origin, source))
    return waits, messages
