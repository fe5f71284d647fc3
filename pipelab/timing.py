"""Run a schedule's dependencies on virtual clocks — the one loop every interpreter shares.

Each device executes its list in order; an action starts when its device is free and
every action it depends on has finished (plus a communication delay when that action ran
on another device):

    start(a) = max(end(previous action on a's device),
                   max over dependencies d of end(d) + delay(d, a))
    end(a)   = start(a) + duration(a)

The loop is event-driven: a device advances until its next action waits for a result
not yet computed, then parks on that result; finishing an action wakes the devices
parked on it.  Every action is handled once, so the cost is O(actions).  If devices are
still parked when nothing is left to wake them, the schedule deadlocks and `Timing.stuck`
says who waits for what.  `validate`, `Schedule.to_text`, the simulator and the local
engine's replay of measured durations are all this loop with different durations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from .actions import NEEDS, Action, Schedule

Duration = Callable[[Action], float]
Delay = Callable[[Action, Action], float]  # (producer, consumer) -> seconds on the link between them


@dataclass
class Timing:
    order: list[Action]  # every action that ran, in the order the loop timed them (dependencies first)
    starts: list[float]  # starts[k] and ends[k] belong to order[k]
    ends: list[float]
    stuck: dict[int, tuple[Action, Action]]  # device -> (its next action, the result it waits for)

    @cached_property
    def start(self) -> dict[Action, float]:
        return dict(zip(self.order, self.starts))

    @cached_property
    def end(self) -> dict[Action, float]:
        return dict(zip(self.order, self.ends))

    @property
    def makespan(self) -> float:
        return max(self.ends, default=0.0) - min(self.starts, default=0.0)

    def time_order(self) -> list[Action]:
        """`order` sorted by start time (ties keep dependency order): how a single host issues the work."""
        return [a for _, _, a in sorted(zip(self.starts, range(len(self.order)), self.order))]


def run_dependencies(schedule: Schedule, duration: Duration, delay: Delay | None = None) -> Timing:
    """Time every action of `schedule` (see the module docstring for the rule).

    The schedule must be well formed (`pipelab.schedules.check_structure`): every stage and
    micro-batch in range.  The end times live in one table per kind, ended[kind][stage][mb],
    so that looking up what an action needs costs two list indexings (see `NEEDS`).
    """
    actions, n_stages = schedule.actions, schedule.n_stages
    stage_device = schedule.device_of_stage()
    ended = {kind: [[None] * schedule.n_microbatches for _ in range(n_stages)] for kind in NEEDS}
    order, starts, ends = [], [], []
    next_index = [0] * len(actions)
    device_free = [0.0] * len(actions)
    parked: dict[tuple, list[int]] = {}
    waiting_for: dict[int, tuple[Action, Action]] = {}
    runnable = deque(range(len(actions)))
    record_action, record_start, record_end = order.append, starts.append, ends.append  # hot loop

    while runnable:
        device = runnable.popleft()
        row = actions[device]
        index, ready_at = next_index[device], device_free[device]
        while index < len(row):
            action = row[index]
            kind, stage, mb = action
            ready, missing = ready_at, None
            for need, offset in NEEDS[kind]:
                source = stage + offset
                if not 0 <= source < n_stages:
                    continue
                finished = ended[need][source][mb]
                if finished is None:
                    missing = (need, source, mb)
                    break
                if delay is not None and stage_device[source] != device:
                    finished += delay(Action(need, source, mb), action)
                if finished > ready:
                    ready = finished
            if missing is not None:
                parked.setdefault(missing, []).append(device)
                waiting_for[device] = (action, Action(*missing))
                break
            ready_at = ready + duration(action)
            ended[kind][stage][mb] = ready_at
            record_action(action)
            record_start(ready)
            record_end(ready_at)
            index += 1
            if parked:
                runnable.extend(parked.pop(action, ()))
        else:
            waiting_for.pop(device, None)
        next_index[device], device_free[device] = index, ready_at

    return Timing(order, starts, ends, waiting_for)


def unit_time_grid(schedule: Schedule) -> str:
    """Draw `schedule` with every action one time step long (see `Schedule.to_text`)."""
    from .schedules import check_structure

    check_structure(schedule)  # names a missing, repeated or out-of-range action
    timing = run_dependencies(schedule, duration=lambda a: 1.0)
    if timing.stuck:
        from .errors import ScheduleError

        stuck = ", ".join(f"device {d} at {a} (waits for {n})" for d, (a, n) in sorted(timing.stuck.items()))
        raise ScheduleError(f"cannot draw a schedule that deadlocks: {stuck}; run pl.schedules.validate for details")
    steps = int(round(timing.makespan))
    grid = [["."] * steps for _ in range(schedule.n_devices)]
    for device, row in enumerate(schedule.actions):
        for action in row:
            if action in timing.start:
                label = str(action) if action.stage != device else f"{action.kind}{action.microbatch}"
                grid[device][int(round(timing.start[action]))] = label
    width = max((len(cell) for line in grid for cell in line), default=1)
    label_width = len(str(schedule.n_devices - 1))
    lines = []
    for device, cells in enumerate(grid):
        body = " ".join(cell.ljust(width) for cell in cells).rstrip()
        lines.append(f"device {device:>{label_width}} | {body}".rstrip())
    return "\n".join(lines)
