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
from typing import Callable

from .actions import Action, Schedule, dependencies

Duration = Callable[[Action], float]
Delay = Callable[[tuple, Action], float]  # (producer as a (kind, stage, microbatch) tuple, consumer) -> seconds


@dataclass
class Timing:
    start: dict[Action, float]
    end: dict[Action, float]
    order: list[Action]  # every action that ran, in the order the loop timed them (dependencies first)
    stuck: dict[int, tuple[Action, Action]]  # device -> (its next action, the result it waits for)

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0) - min(self.start.values(), default=0.0)

    def time_order(self) -> list[Action]:
        """`order` sorted by start time (ties keep dependency order): how a single host issues the work."""
        rank = {a: i for i, a in enumerate(self.order)}
        return sorted(self.order, key=lambda a: (self.start[a], rank[a]))


def run_dependencies(schedule: Schedule, duration: Duration, delay: Delay | None = None) -> Timing:
    """Time every action of `schedule` (see the module docstring for the rule)."""
    actions = schedule.actions
    n_stages = schedule.n_stages
    device_of = {a: d for d, row in enumerate(actions) for a in row} if delay is not None else {}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    order: list[Action] = []
    next_index = [0] * len(actions)
    device_free = [0.0] * len(actions)
    parked: dict[Action, list[int]] = {}
    waiting_for: dict[int, tuple[Action, Action]] = {}
    runnable = deque(range(len(actions)))

    finished_at, append_order, wake = end.get, order.append, parked.pop  # local names: this loop is hot
    while runnable:
        device = runnable.popleft()
        row = actions[device]
        index, ready_at = next_index[device], device_free[device]
        while index < len(row):
            action = row[index]
            ready, missing = ready_at, None
            for needed in dependencies(action, n_stages):
                finished = finished_at(needed)
                if finished is None:
                    missing = needed
                    break
                if delay is not None and device_of.get(needed) != device:
                    finished += delay(needed, action)
                if finished > ready:
                    ready = finished
            if missing is not None:
                parked.setdefault(missing, []).append(device)
                waiting_for[device] = (action, Action(*missing))
                break
            start[action] = ready
            end[action] = ready_at = ready + duration(action)
            append_order(action)
            index += 1
            woken = wake(action, None)
            if woken:
                runnable.extend(woken)
        else:
            waiting_for.pop(device, None)
        next_index[device], device_free[device] = index, ready_at

    return Timing(start, end, order, waiting_for)


def unit_time_grid(schedule: Schedule) -> str:
    """Draw `schedule` with every action one time step long (see `Schedule.to_text`)."""
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
