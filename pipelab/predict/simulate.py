"""`simulate(schedule, costs)`: predict a step's timeline and memory from a cost model.

The same dependency loop as every other interpreter (`pipelab.schedules.dependencies`): each device runs
its list in order; an action starts when its device is free and its inputs have arrived,
a message across a stage boundary taking latency + bytes / bandwidth.  Deterministic,
O(actions) plus one sort.  Activation memory follows `pipelab.predict.memory`: +memory_bytes[s]
when F(s, i) ends, released when stage s is done with micro-batch i (end of its B, or of
its W when the backward is split: at I's end all but `weight_memory_bytes[s]`, what W needs,
when the costs give it), as the engines count it.  Each kind of action
takes the `Costs` field its `KindSpec.cost` names (I: `backward`, the input-gradient half).
"""

from __future__ import annotations

from typing import Mapping

from ..common.gc_pause import gc_paused
from ..schedules.action import GRADIENT_KINDS, KIND_SPECS, Action, Kind
from ..schedules.dependencies import run_dependencies
from ..schedules.schedule import Schedule, check_structure
from ..schedules.trace import MemorySample, Trace
from ..schedules.validate import explain_stuck
from .costs import Costs
from .memory import activation_samples, checkpoint_plan


def simulate(schedule: Schedule, costs: Costs | Mapping[Action, float] | None = None,
             checkpoint: str | list[bool] = "never") -> Trace:
    """Run `schedule` on the cost model `costs` (default: t_F = 1, t_B = 2, free links).

    `costs` may also map every action to its seconds — e.g. `trace.durations()` of a
    measured step — to replay that step exactly (free links, no memory model).
    `checkpoint` (as in `Pipeline`): a checkpointed stage's B also runs its forward again
    (t_B + t_F), it keeps only `input_bytes` between F and B, and during B it holds the
    recomputed activations, memory_bytes - input_bytes, on top.
    """
    with gc_paused():  # the loop makes an Event per action and no reference cycles
        return _simulate(schedule, costs, checkpoint)


def _simulate(schedule: Schedule, costs: Costs | Mapping[Action, float] | None, checkpoint) -> Trace:
    """The body of `simulate`, run with the garbage collector paused."""
    check_structure(schedule)
    p = schedule.n_stages
    recompute = checkpoint_plan(checkpoint, p)
    if isinstance(costs, Mapping):
        missing = [a for a in schedule.all_actions() if a not in costs]
        if missing:
            raise ValueError(f"the durations give no time for {missing[0]} ({len(missing)} actions missing)")
        duration, costs = dict(costs).__getitem__, Costs()
    else:
        costs = Costs() if costs is None else costs
        if not isinstance(costs, Costs):
            raise TypeError(f"costs must be a pl.Costs or a dict of action durations, got {type(costs).__name__}")
        duration = {kind: [costs.per_stage(spec.cost, s, p) for s in range(p)] for kind, spec in KIND_SPECS.items()}
        for kind in GRADIENT_KINDS:  # a checkpointed stage runs its forward again before its backward
            duration[kind] = [b + (f if again else 0.0) for b, f, again in zip(duration[kind], duration[Kind.F], recompute)]
    # the link between stages b and b + 1 carries F(b)'s output and the gradient B(b + 1) sends back
    timing = run_dependencies(schedule, duration, [costs.message_seconds(b, p) for b in range(p - 1)])
    explain_stuck(schedule, timing)  # a deadlock does not depend on the durations
    events = timing.events
    full = [costs.per_stage("memory_bytes", s, p) for s in range(p)]
    inputs = [costs.per_stage("input_bytes", s, p) for s in range(p)]
    held = [inputs[s] if recompute[s] else full[s] for s in range(p)]
    transient = [max(full[s] - inputs[s], 0.0) if recompute[s] else 0.0 for s in range(p)]
    for_w = None
    if costs.weight_memory_bytes is not None:
        kept_for_w = [costs.per_stage("weight_memory_bytes", s, p) for s in range(p)]
        for_w = lambda s, i: kept_for_w[s]  # noqa: E731
    if any(held) or any(transient):
        memory = activation_samples(events, lambda s, i: held[s], lambda s, i: transient[s], schedule.n_devices,
                                    for_w)
    else:  # no memory model: every device holds nothing all along
        memory = [MemorySample(d, 0.0, 0) for d in range(schedule.n_devices)]
    return Trace(events, memory, "simulated", p, schedule.n_microbatches, schedule.n_devices, schedule.name)
