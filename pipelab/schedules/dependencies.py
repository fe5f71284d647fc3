"""Run a schedule's dependencies on virtual clocks — the one loop every interpreter shares.

Each device executes its list in order; an action starts when its device is free and
every action it depends on has finished (plus the link's time when that action ran on
another device):

    start(a) = max(end(previous action on a's device),
                   max over dependencies d of end(d) + link(d, a))
    end(a)   = start(a) + duration(a)

The loop is event-driven: a device advances until its next action waits for a result
not yet computed, then parks on that result; finishing an action wakes the devices parked
on it.  Every action is timed once, so the cost is O(actions).  If devices are still
parked when nothing is left to wake them, the schedule deadlocks and `Timing.stuck` says
who waits for what.  `validate`, `Schedule.to_text`, the simulator and the local engine's
replay of measured durations are all this loop with different durations.

The loop reads only a schedule's `n_stages`, `n_microbatches`, `actions` and
`device_of_stage()`; it does not import `Schedule`, whose `to_text` runs this loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property
from itertools import count
from typing import Callable, Mapping, Sequence

from .action import KINDS, NEEDS, Action
from .trace import Event

Duration = Callable[[Action], float] | Mapping[str, Sequence[float]]
INF = float("inf")


@dataclass
class Timing:
    events: list[Event]  # every action that ran, timed, in the order the loop timed them (dependencies first)
    stuck: dict[int, tuple[Action, Action]]  # device -> (its next action, the result it waits for)

    @cached_property
    def order(self) -> list[Action]:
        return [Action(e.kind, e.stage, e.microbatch) for e in self.events]

    @cached_property
    def start(self) -> dict[Action, float]:
        return {Action(e.kind, e.stage, e.microbatch): e.start for e in self.events}

    @cached_property
    def end(self) -> dict[Action, float]:
        return {Action(e.kind, e.stage, e.microbatch): e.end for e in self.events}

    @property
    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def time_order(self) -> list[Action]:
        """`order` sorted by start time (ties keep dependency order): how a single host issues the work."""
        return [a for _, _, a in sorted(zip((e.start for e in self.events), count(), self.order))]


def _cross_stage_consumers() -> dict[str, int]:
    """kind -> the stage offset of the one action on a neighbouring stage that needs its result.

    From `NEEDS`: F(s) feeds F(s + 1) (offset +1), B(s) feeds B(s - 1) (offset -1), W feeds
    nobody across stages.  The link time is stored per producer, so a kind may have one such
    consumer at most.
    """
    found: dict[str, int] = {}
    for needs in NEEDS.values():
        for need, offset in needs:
            if offset:
                if need in found:
                    raise AssertionError(f"NEEDS gives {need} two consumers on other stages; the loop stores one link")
                found[need] = -offset
    return found


_CONSUMER_OFFSET = _cross_stage_consumers()


class _Clocks:
    """Every time the loop keeps, in one flat list, so that a lookup is one indexing.

    The list holds regions of (p + 2) * m slots, one slot per (stage, micro-batch), with
    stages -1 and p as padding:

        region k (one per kind)     when each action of that kind ends
        region K ("nothing")        -inf everywhere: the need a kind with one need lacks
        region K + 1 + k            when each result of kind k arrives at the neighbouring
                                    stage (end + link); used only when links cost time

    What an action needs (`NEEDS`) sits a fixed step from its own slot, the same step for
    every action of a kind: F(s, i) needs F(s - 1, i), m slots back.  Padding reads -inf (a
    need that does not exist delays nobody); a slot not yet computed reads +inf.
    """

    def __init__(self, schedule: "Schedule", linked: bool):
        p, m = schedule.n_stages, schedule.n_microbatches
        self.m, self.span = m, (p + 2) * m
        n_regions = 2 * len(KINDS) + 1
        self.times = [INF] * (n_regions * self.span)
        for r in range(n_regions):
            self.times[r * self.span:r * self.span + m] = [-INF] * m  # stage -1
            self.times[(r + 1) * self.span - m:(r + 1) * self.span] = [-INF] * m  # stage p
        nothing = len(KINDS) * self.span
        self.times[nothing:nothing + self.span] = [-INF] * self.span
        self.to_arrival = (len(KINDS) + 1) * self.span  # from a slot to the same slot's arrival
        self.layout = {}  # kind -> (slot of stage 0 mb 0, step to its first need, step to its second)
        for k, kind in enumerate(KINDS):
            here = self.first_slot(k)
            steps = [self.first_slot(KINDS.index(need)) + offset * m - here
                     + (self.to_arrival if offset and linked else 0) for need, offset in NEEDS[kind]]
            steps += [nothing - here] * (2 - len(steps))
            self.layout[kind] = (here, *steps)

    def first_slot(self, region: int) -> int:
        return region * self.span + self.m

    def per_slot(self, values: Mapping[str, Sequence[float]]) -> list[float]:
        """A list indexed like the kinds' regions holding values[kind][stage] in each slot of that stage."""
        table = [0.0] * (len(KINDS) * self.span)
        for kind, per_stage in values.items():
            here = self.layout[kind][0]
            for stage, value in enumerate(per_stage):
                table[here + stage * self.m:here + (stage + 1) * self.m] = [value] * self.m
        return table

    def action_at(self, slot: int) -> Action:
        """The action whose end `slot` holds."""
        region, rest = divmod(slot, self.span)
        return Action(KINDS[region], rest // self.m - 1, rest % self.m)


def _link_per_producer(schedule: "Schedule", links: Sequence[float]) -> dict[str, list[float]]:
    """kind -> per stage s: seconds from the end of (kind, s) until its consumer on the next stage has it."""
    p = schedule.n_stages
    device_of = schedule.device_of_stage()
    per_kind = {}
    for kind, offset in _CONSUMER_OFFSET.items():
        per_kind[kind] = [links[min(s, s + offset)] if 0 <= s + offset < p and device_of[s] != device_of[s + offset]
                          else 0.0 for s in range(p)]
    return per_kind


def run_dependencies(schedule: "Schedule", duration: Duration, links: Sequence[float] | None = None) -> Timing:
    """Time every action of `schedule` (see the module docstring for the rule).

    `duration` gives an action's seconds: a function of the Action, or {kind: seconds per
    stage} (the simulator's form, which costs nothing per action).  `links[b]` is the time a
    message takes between stages b and b + 1 — F(b) to F(b + 1), B(b + 1) to B(b) — paid
    only when the two stages are on different devices.  The schedule must be well formed
    (`pipelab.schedules.check_structure`): every stage and micro-batch in range.
    """
    rows, p, m = schedule.actions, schedule.n_stages, schedule.n_microbatches
    if links is not None and len(links) != max(p - 1, 0):
        raise ValueError(f"links gives {len(links)} times for {p} stages; give one per boundary ({max(p - 1, 0)})")
    linked = links is not None and any(links)
    clocks = _Clocks(schedule, linked)
    times, layout, to_arrival = clocks.times, clocks.layout, clocks.to_arrival
    if callable(duration):
        seconds = [0.0] * (len(KINDS) * clocks.span)
        for action in schedule.all_actions():
            seconds[layout[action.kind][0] + action.stage * m + action.microbatch] = duration(action)
    else:
        seconds = clocks.per_slot(duration)
    if linked:
        link = clocks.per_slot(_link_per_producer(schedule, links))
    events: list[Event] = []
    record, new_event = events.append, tuple.__new__  # hot loop: new_event(Event, fields) runs no Python code
    # slot -> the device parked on it.  One is enough: a result is awaited by one action on another
    # stage (_CONSUMER_OFFSET) and by actions of its own stage, which run on its own device; that
    # device can wait for it only if it comes later in its own list, a deadlock that wakes no one.
    parked_on: list[int | None] = [None] * len(seconds)
    waits_for: dict[int, int] = {}  # device -> the slot it waits for
    next_index = [0] * len(rows)
    device_free = [0.0] * len(rows)
    runnable = deque(range(len(rows)))

    while runnable:
        device = runnable.popleft()
        row = rows[device]
        index, ready_at = next_index[device], device_free[device]
        while index < len(row):
            action = row[index]
            kind, stage, mb = action
            here, step_a, step_b = layout[kind]
            slot = here + stage * m + mb
            ready = times[slot + step_a]
            other = times[slot + step_b]
            if other > ready:
                ready = other
            if ready == INF:  # a need has not been computed yet: park on it
                missing = slot + step_a if times[slot + step_a] == INF else slot + step_b
                if missing >= to_arrival:  # an arrival: wait for the action that sends it
                    missing -= to_arrival
                parked_on[missing] = device
                waits_for[device] = missing
                break
            if ready_at > ready:
                ready = ready_at
            ready_at = ready + seconds[slot]
            times[slot] = ready_at
            if linked:
                times[slot + to_arrival] = ready_at + link[slot]
            record(new_event(Event, (stage, kind, mb, ready, ready_at, device)))
            index += 1
            if parked_on[slot] is not None:
                runnable.append(parked_on[slot])
        next_index[device], device_free[device] = index, ready_at

    stuck = {device: (rows[device][next_index[device]], clocks.action_at(slot))
             for device, slot in waits_for.items() if next_index[device] < len(rows[device])}
    return Timing(events, stuck)
