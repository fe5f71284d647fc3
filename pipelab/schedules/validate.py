"""`validate`: check any schedule — generated or written by hand — and explain the first problem.

The structure (`check_structure`) first, then the dependencies, by running them on unit
times: a device that waits for something later in its own list, or a cycle of devices
waiting on each other, is named with the actions concerned.
"""

from __future__ import annotations

from ..common.errors import ScheduleError
from .action import Action
from .dependencies import run_dependencies
from .schedule import Schedule, check_structure


def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` and return it, or raise `ScheduleError` naming the first problem.

    Checked in order: `asynchronous` is a bool and `update_every` a positive int; every entry is an
    Action with a known kind, stage and micro-batch;
    no action appears twice; each stage runs on one device; every micro-batch has its F and
    its B on every stage (or its I and W, on a stage that splits the backward); and the dependencies can all be met —
    found by running them (`run_dependencies`): a device whose next action waits for
    something later in its own list, or a cycle of devices waiting on each other.
    """
    check_structure(schedule)
    explain_stuck(schedule, run_dependencies(schedule, duration=lambda a: 1.0))
    return schedule


def explain_stuck(schedule: Schedule, timing) -> None:
    """Raise ScheduleError explaining why the run `timing` of `schedule` got stuck (no-op if it finished)."""
    if not timing.stuck:
        return
    device_of = {a: d for d, row in enumerate(schedule.actions) for a in row}
    position = {a: i for row in schedule.actions for i, a in enumerate(row)}
    # Each stuck device waits on an action of a stuck device: follow the waits to a cycle.
    device, path = min(timing.stuck), []
    while device not in path:
        path.append(device)
        device = device_of[timing.stuck[device][1]]
    cycle = path[path.index(device):]
    if len(cycle) == 1:
        action, needed = timing.stuck[device]
        raise ScheduleError(
            f"device {device} runs {action} ({action.describe()}) at position {position[action]}, but it needs "
            f"{needed} ({needed.describe()}), which comes later in the same list (position {position[needed]}): "
            f"{_why(action, needed)}"
        )
    waits = []
    for d in cycle:
        action, needed = timing.stuck[d]
        other = device_of[needed]
        before = schedule.actions[other][_first_unrun(schedule, timing, other)]
        waits.append(
            f"device {d} waits at {action} for {needed} from device {other}, which is still stuck at {before}"
        )
    raise ScheduleError("deadlock, a cycle of waits between devices: " + "; ".join(waits))


def _first_unrun(schedule: Schedule, timing, device: int) -> int:
    """Position of the first action of `device` that never ran."""
    return next(i for i, a in enumerate(schedule.actions[device]) if a not in timing.end)


def _why(action: Action, needed: Action) -> str:
    if needed.stage == action.stage:
        return f"a {action.spec.name} needs its own {needed.spec.name} first"
    if action.spec.sends > 0:  # F, E: the input comes from the previous stage
        return f"a {action.spec.name} needs the previous stage's {needed.spec.name} of the same micro-batch (its input)"
    return (f"a {action.spec.name} needs the gradient the next stage's {needed.spec.name} ({needed.kind.value}) "
            "sends back for the same micro-batch")
