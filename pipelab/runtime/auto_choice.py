"""split_method="auto" and schedule="auto": measure, decide (`predict/auto_plan.py`), and turn the decision
into the concrete options the rest of the engine runs — a cut (split points, or a `Partition` of an
`nn.Sequential`) and a schedule (a name, or the interleaved or searched `Schedule` itself).

    decide_options(model, options, n_devices, ...)  ->  (AutoPlan, Choice)   where it is measured
    apply(choice, model, options)                   ->  the options with it    on every rank

What is measured: one micro-batch of `sample` (the first of the whole batch), through every piece
(`predict/piece_costs.py`): the blocks of an `nn.Sequential`, or a model split by names before every
place `model/cut_points.py` finds.  With split_method="auto" the cut is chosen among those places; with
only schedule="auto" the user's cut ("uniform", "params", "time", split points, a Partition) is
measured as it is and only the schedule is chosen.  On ranks, every rank measures at once and rank 0's
plan goes to every rank (`RankPlacement.decide`), so every rank builds the same pipeline.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import nn

from ..model import microbatch
from ..model.named_timing import loss_or_sum
from ..model.partition import Partition, points_for
from ..predict.auto_plan import NAMED, SCHEDULES, AutoPlan, decide
from ..predict.budget import check_limit, device_memory
from ..predict.piece_costs import measure_pieces, measure_stages, pieces_and_points
from ..schedules.generators import by_name
from .options import PipelineOptions
from .step import build_partition

AUTO = "auto"


def wants_decision(options: PipelineOptions) -> bool:
    return options.split_method == AUTO or options.schedule == AUTO


@dataclasses.dataclass(frozen=True)
class Choice:
    """What was chosen, in a form every rank can apply (plain data): the schedule (a name, or the `Schedule`),
    and the cut (a model split by names: its split points; an nn.Sequential: its blocks' bounds; None: as given)."""

    schedule: Any
    split_points: list[str] | None = None
    block_bounds: list[tuple[int, int]] | None = None


def decide_options(model: nn.Module, options: PipelineOptions, n_devices: int, *, interleave: bool,
                   latency: float = 0.0, bandwidth: float = math.inf,
                   engine: dict | None = None) -> tuple[AutoPlan, Choice]:
    """The decision for a pipeline of `n_devices` devices (module docstring) and its choice; `interleave`: the
    placement can run two stages per device; `latency`, `bandwidth`: its links; `engine`: what its engine adds
    to every action and message, per family of schedules (`engine_costs.py`)."""
    names = _schedules(options)
    inputs, targets = _first_microbatch(options)
    loss_fn = options.loss_fn if options.loss_fn is not None and targets is not None else _own_or_sum
    threads, m = options.threads, options.n_microbatches
    if options.split_method == AUTO:
        if options.split_points is not None:
            raise ValueError("split_points names where to cut and split_method='auto' chooses it: give one of them")
        points, named = pieces_and_points(model, inputs)
        pieces, modules = measure_pieces(model, points, named, (inputs, targets), loss_fn, threads)
        cut = None
    else:  # the user's cut, measured as it is: each stage one piece
        named = not isinstance(model, nn.Sequential)
        split_points = options.split_points
        if named and split_points is None:
            split_points = points_for(model, n_devices, options.split_method, inputs, threads)
        whole = options.sample[0] if _is_pair(options.sample) else options.sample
        partition = build_partition(model, n_devices, m, options.split_method, split_points, whole, threads)
        pieces, modules = measure_stages(model, partition, (inputs, targets), loss_fn, threads), partition.stages
        cut = [(s, s + 1) for s in range(n_devices)]
    limits = None if options.memory_limit_bytes is None else check_limit(options.memory_limit_bytes, n_devices)
    state = options.optimizer if options.optimizer is not None else options.memory_optimizer

    def needs(bounds, schedule, costs):
        stages = [nn.ModuleList(modules[a:b]) for a, b in bounds]
        return device_memory(stages, schedule, costs, state, options.checkpoint)

    plan = decide(pieces, n_devices, m, cut=cut, schedules=names, interleave=interleave, latency=latency,
                  bandwidth=bandwidth, engine=engine, checkpoint=options.checkpoint, needs=None if limits is None else needs,
                  limits=limits)
    chosen = plan.chosen
    schedule = chosen.schedule_name if chosen.schedule_name in NAMED else chosen.schedule
    if cut is not None:  # the cut as given (a Partition stays; a cut by method is fixed: the one priced)
        fixed = None if isinstance(options.split_method, Partition) or named else partition.bounds
        return plan, Choice(schedule, split_points if named else None, fixed)
    return plan, Choice(schedule, plan.split_points() if named else None,
                        None if named else list(chosen.bounds))


def apply(choice: Choice, model: nn.Module, options: PipelineOptions) -> PipelineOptions:
    """`options` with `choice` filled in: the schedule's name (a named one, so a partial last batch can rebuild
    it) or the `Schedule`; the cut as split points, or an nn.Sequential's `Partition` of its blocks."""
    options = dataclasses.replace(options, schedule=choice.schedule)
    if choice.split_points is not None:
        method = "uniform" if options.split_method == AUTO else options.split_method
        return dataclasses.replace(options, split_method=method, split_points=list(choice.split_points))
    if choice.block_bounds is not None:
        bounds = [tuple(b) for b in choice.block_bounds]
        partition = Partition(bounds, [model[a:b] for a, b in bounds], AUTO, [1.0] * len(model))
        return dataclasses.replace(options, split_method=partition)
    return options


def _is_pair(sample: Any) -> bool:
    return isinstance(sample, tuple) and len(sample) == 2


def _schedules(options: PipelineOptions) -> tuple[str, ...]:
    """What to choose among: every schedule (`SCHEDULES`) for schedule="auto", else the one named."""
    if options.schedule == AUTO:
        return SCHEDULES
    if not isinstance(options.schedule, str):
        raise ValueError("split_method='auto' prices each cut under a named schedule ('gpipe', '1f1b', 'zb-h1') or "
                         "under schedule='auto'; a hand-made Schedule fixes the stages: cut the model yourself")
    name = by_name(options.schedule, 2, 2).name  # its canonical name ("pipedream-flush" -> "1f1b")
    if name not in NAMED:
        raise ValueError(f"split_method='auto' prices synchronous schedules {NAMED}; {options.schedule!r} updates the "
                         "weights during the step (its cost is not one step's): choose the cut yourself")
    return (name,)


def _first_microbatch(options: PipelineOptions) -> tuple[Any, Any]:
    """One micro-batch of `sample`: (inputs, targets) of an nn.Sequential's (inputs, targets) pair or inputs, or
    (keyword arguments, None) of a model split by names."""
    if options.sample is None:
        raise ValueError("split_method='auto' and schedule='auto' measure the model on a batch: pass sample=<a whole "
                         "batch: (inputs, targets), or inputs only; for a model split by names its keyword arguments>")
    sample, targets = options.sample if _is_pair(options.sample) else (options.sample, None)
    first = microbatch.split(sample, options.n_microbatches)[0]
    return first, (None if targets is None else microbatch.split(targets, options.n_microbatches)[0])


def _own_or_sum(output: Any, target: Any):
    """Without targets: the model's own loss, or the sum of its outputs (a backward of the same shapes; the
    loss's own cost is then left out)."""
    return loss_or_sum(output)
