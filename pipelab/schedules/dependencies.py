"""Run a schedule's dependencies on virtual clocks — the one loop every interpreter shares.

Each device executes its list in order; an action starts when its device is free and
every action it needs (`KIND_SPECS`) has finished, plus the link's time when that action
ran on another device:

    start(a) = max(end(previous action on a's device),
                   max over the needs n of a: end(n) + link(n, a))
    end(a)   = start(a) + duration(a)

Every action is timed once: O(actions); devices still parked when nothing is left to wake
them are a deadlock (`Timing.stuck`).  `validate`, `Schedule.to_text`, the simulator and the
local engine's replay are this loop with other durations.  Details: docs/simulator.md, "The
dependency loop".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property
from itertools import count
from typing import Callable, Mapping, Sequence

from .action import GRADIENT, KIND_SPECS, Action, Kind
from .trace import Event

Duration = Callable[[Action], float] | Mapping[str, Sequence[float]]


@dataclass
class Timing:
    events: list[Event]  # every action that ran, timed, in the order the loop timed them (dependencies first)
    stuck: dict[int, tuple[Action, Action]]  # device -> (its next action, the result it waits for)

    @cached_property
    def order(self) -> list[Action]:
        return [e.action for e in self.events]

    @cached_property
    def start(self) -> dict[Action, float]:
        return {e.action: e.start for e in self.events}

    @cached_property
    def end(self) -> dict[Action, float]:
        return {e.action: e.end for e in self.events}

    @property
    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def time_order(self) -> list[Action]:
        """`order` sorted by start time (ties keep dependency order): how a single host issues the work."""
        return [a for _, _, a in sorted(zip((e.start for e in self.events), count(), self.order))]


def needs_by_kind_and_stage(schedule: "Schedule", links: Sequence[float] | None = None
                            ) -> dict[tuple[Kind, int], list[tuple[Kind, int, float, int]]]:
    """(kind, stage) -> what an action of that kind on that stage needs: [(kind, stage, seconds its
    result takes to arrive, micro-batches earlier)], the same for every micro-batch.  `links[b]` is paid
    between stages b and b + 1 when they are on different devices.  The last field is 0 but for a kind
    that wraps (generation's G on stage 0 needs the last stage's G `lanes` micro-batches earlier: the
    same lane's token of the round before; on the first round it has no such need)."""
    p = schedule.n_stages
    device_of, gradient_kind = schedule.device_of_stage(), schedule.gradient_kind
    lanes = schedule.meta.get("lanes", 0)
    found = {}
    for kind, spec in KIND_SPECS.items():
        for stage in range(p):
            needs = []
            for need, offset in spec.needs:
                other, earlier = stage + offset, 0
                if spec.wraps and other == -1 and lanes:
                    other, earlier = p - 1, lanes
                if not 0 <= other < p:
                    continue  # a need that does not exist: before stage 0, after the last stage
                need_kind = gradient_kind[other] if need == GRADIENT else need
                linked = links is not None and device_of.get(other) != device_of.get(stage)
                delay = (links[min(stage, other)] if other != stage else 0.0) if linked else 0.0
                needs.append((need_kind, other, delay, earlier))
            found[kind, stage] = needs
    return found


def run_dependencies(schedule: "Schedule", duration: Duration, links: Sequence[float] | None = None) -> Timing:
    """Time every action of `schedule` (see the module docstring for the rule).

    `duration` gives an action's seconds: a function of the Action, or {kind: seconds per
    stage} (the simulator's form).  `links[b]` is the time a message takes between stages b
    and b + 1, paid only when the two stages are on different devices.  The schedule must be
    well formed (`check_structure`): every stage and micro-batch in range.
    """
    rows, p = schedule.actions, schedule.n_stages
    if links is not None and len(links) != max(p - 1, 0):
        raise ValueError(f"links gives {len(links)} times for {p} stages; give one per boundary ({max(p - 1, 0)})")
    needs = needs_by_kind_and_stage(schedule, links)
    table = None if callable(duration) else {
        (kind, stage): seconds for kind, per_stage in duration.items() for stage, seconds in enumerate(per_stage)}
    seconds_of = duration if table is None else lambda action: table[action[0], action[1]]  # noqa: E731
    # Each result has a slot, (kind, stage, micro-batch) numbered from 0: `end[slot]` is when it ends.
    # A list and integer slots, not a dict of tuples: this loop runs once per action, and the simulator
    # (benchmarks/simulator.py, part 1) needs >= 500k actions/s.
    m, kinds = schedule.n_microbatches, list(KIND_SPECS)
    first_slot = {(kind, stage): (k * p + stage) * m for k, kind in enumerate(kinds) for stage in range(p)}
    plan = {key: (first_slot[key], [(first_slot[kind, stage] - earlier, delay, earlier)
                                    for kind, stage, delay, earlier in wanted],
                  None if table is None else table.get(key))
            for key, wanted in needs.items()}  # (its first slot, its needs' first slots, delays and first micro-batch
    #                                                     that has them (0 but for a wrap), its seconds)
    end: list[float | None] = [None] * (len(kinds) * p * m)
    parked: dict[int, list[int]] = {}  # a slot not yet computed -> the devices waiting for it
    waits_for: dict[int, int] = {}  # device -> the slot it waits for
    events: list[Event] = []
    position, free = [0] * len(rows), [0.0] * len(rows)
    runnable = deque(range(len(rows)))
    make_event, add_event, wake = tuple.__new__, events.append, runnable.extend
    while runnable:
        device = runnable.popleft()
        row, k, ready_at = rows[device], position[device], free[device]
        while k < len(row):
            action = row[k]
            kind, stage, mb = action
            here, wanted, seconds = plan[kind, stage]
            start = ready_at
            for need, delay, first in wanted:
                if mb < first:  # a wrapping need before its first round: none
                    continue
                done = end[need + mb]
                if done is None:  # not computed yet: park on it
                    parked.setdefault(need + mb, []).append(device)
                    waits_for[device] = need + mb
                    break
                if done + delay > start:
                    start = done + delay
            else:
                ready_at = start + (seconds_of(action) if seconds is None else seconds)
                end[here + mb] = ready_at
                add_event(make_event(Event, (kind, stage, mb, start, ready_at, device)))
                k += 1
                if parked:
                    wake(parked.pop(here + mb, ()))
                continue
            break
        position[device], free[device] = k, ready_at
    stuck = {device: (rows[device][position[device]], Action(kinds[slot // (p * m)], slot // m % p, slot % m))
             for device, slot in waits_for.items() if position[device] < len(rows[device])}
    return Timing(events, stuck)
