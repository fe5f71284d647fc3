"""`simulate(schedule, costs)`: predict a step's timeline and memory from a cost model.

The same dependency loop as every other interpreter (`pipelab.timing`): each device runs
its list in order; an action starts when its device is free and its inputs have arrived,
a message across a stage boundary taking latency + bytes / bandwidth.  Deterministic,
O(actions) plus one sort.  Activation memory per device rises by `memory_bytes[s]` when
F(s, i) ends and falls again when stage s is done with micro-batch i (end of its B, or
of its W when the backward is split), as the local engine measures it.
"""

from __future__ import annotations

from typing import Mapping

from .actions import Action, Schedule
from .costs import Costs
from .schedules import validate
from .timing import run_dependencies
from .trace import Event, MemorySample, Trace


def simulate(schedule: Schedule, costs: Costs | Mapping[Action, float] | None = None) -> Trace:
    """Run `schedule` on the cost model `costs` (default: t_F = 1, t_B = 2, free links).

    `costs` may also map every action to its seconds — e.g. `trace.durations()` of a
    measured step — to replay that step exactly (free links, no memory model).
    """
    validate(schedule)
    p = schedule.n_stages
    if isinstance(costs, Mapping):
        missing = [a for a in schedule.all_actions() if a not in costs]
        if missing:
            raise ValueError(f"the durations give no time for {missing[0]} ({len(missing)} actions missing)")
        per_action = dict(costs)
        costs = Costs()
        duration = per_action.__getitem__
    else:
        costs = Costs() if costs is None else costs
        if not isinstance(costs, Costs):
            raise TypeError(f"costs must be a pl.Costs or a dict of action durations, got {type(costs).__name__}")
        kind_cost = {"F": "forward", "B": "backward", "W": "weight"}

        def duration(action: Action) -> float:
            return costs.per_stage(kind_cost[action.kind], action.stage, p)

    def delay(sender: Action, receiver: Action) -> float:
        boundary = min(sender.stage, receiver.stage)  # F(s-1)->F(s) and B(s+1)->B(s) cross boundary s-1 / s
        return costs.message_seconds(boundary, p) if sender.stage != receiver.stage else 0.0

    timing = run_dependencies(schedule, duration, delay)
    device_of = schedule.device_of_stage()
    events = [Event(a.stage, a.kind, a.microbatch, timing.start[a], timing.end[a], device_of[a.stage])
              for a in timing.order]
    return Trace(events, _memory(events, schedule, costs), "simulated", p, schedule.n_microbatches,
                 schedule.n_devices, schedule.name)


def _memory(events: list[Event], schedule: Schedule, costs: Costs) -> list[MemorySample]:
    split_backward = any(e.kind == "W" for e in events)
    frees = "W" if split_backward else "B"
    held = [0.0] * schedule.n_devices
    samples = [MemorySample(d, 0.0, 0) for d in range(schedule.n_devices)]
    for e in sorted(events, key=lambda e: e.end):
        if e.kind not in ("F", frees):
            continue
        size = costs.per_stage("memory_bytes", e.stage, schedule.n_stages)
        held[e.device] += size if e.kind == "F" else -size
        samples.append(MemorySample(e.device, e.end, round(held[e.device])))
    return samples
