"""What a training step is, whatever carries its messages: written once for the local and distributed engines.

Preparation (the schedule validated for p and m, one `StageWorker` per stage this process
runs, the batch cut into micro-batches), the loss weights, and the finish (the step's loss,
as a `StepResult`).  Micro-batch i's mean loss counts n_i / N, so the summed gradients are
those of the mean loss over the whole batch:

    mean over N samples = sum_i (n_i / N) * (mean over micro-batch i)

An asynchronous schedule (PipeDream) gives each micro-batch weight 1: its own minibatch.
Each engine supplies devices, a transport and a clock (`runtime/local.py`,
`runtime/distributed.py`).  Details: docs/engines.md, "What a step is".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..model import microbatch
from ..model.partition import Partition
from ..schedules import by_name, validate
from ..schedules.action import Kind
from ..schedules.schedule import Schedule
from ..schedules.trace import Trace
from .loop import StageWorker
from .weight_stash import WeightStash


@dataclass
class StepResult:
    loss: float  # mean loss over the whole batch
    trace: Trace
    microbatch_losses: list[float]
    wall_seconds: float  # host time for the whole step, engine overhead included
    op_seconds: float  # sum of the measured durations of all actions


def check_loss_fn(loss_fn) -> None:
    if loss_fn is None or not callable(loss_fn):
        raise TypeError("a pipeline needs loss_fn=<callable(output, target) -> mean loss of the micro-batch>")
    if getattr(loss_fn, "reduction", "mean") != "mean":
        raise ValueError(
            f"loss_fn has reduction={loss_fn.reduction!r}; pipelab weights each micro-batch's mean loss by its "
            "size, so the loss must use reduction='mean'"
        )


def check_microbatch_count(n_microbatches) -> None:
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")


def resolve_schedule(schedule: str | Schedule, n_microbatches: int, *, n_stages: int | None = None,
                     n_devices: int | None = None) -> Schedule:
    """A schedule name built for the pipeline (n_stages stages, or one per device of n_devices), or a given
    `Schedule` checked against what the pipeline has (its stages, its devices, its micro-batches), then
    validated."""
    if isinstance(schedule, str):
        schedule = by_name(schedule, n_stages if n_stages is not None else n_devices, n_microbatches)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a name or a pipelab Schedule, got {type(schedule).__name__}")
    if n_stages is not None and (schedule.n_stages, schedule.n_microbatches) != (n_stages, n_microbatches):
        raise ValueError(f"the schedule is for {schedule.n_stages} stages x {schedule.n_microbatches} "
                            f"micro-batches, but the pipeline has {n_stages} x {n_microbatches}")
    if n_devices is not None and schedule.n_devices != n_devices:
        raise ValueError(f"the schedule has {schedule.n_devices} devices but the process group has "
                            f"{n_devices} ranks; start one rank per device ({schedule.n_devices} processes)")
    if schedule.n_microbatches != n_microbatches:
        raise ValueError(f"the schedule is for {schedule.n_microbatches} micro-batches, but "
                            f"n_microbatches={n_microbatches}")
    return validate(schedule)


def make_workers(schedule: Schedule, partition: Partition, stages: list[int], loss_fn: Callable,
                 checkpoint: list[bool], device_of: Callable[[int], Any], rank: int | None = None,
                 optimizer: Callable | None = None, fused_accumulation: bool = True) -> dict[int, StageWorker]:
    """One `StageWorker` for each of `stages`, its backward policy read from the schedule: split where the
    stage runs I and W, a `WeightStash` on every stage of an asynchronous schedule (`optimizer` builds
    each stage's own optimizer, and is needed exactly then)."""
    if not schedule.asynchronous and optimizer is not None:
        raise ValueError("optimizer= is for asynchronous schedules (pipedream-async), whose stages update "
                            "during the step; with this schedule, step your optimizer after pipe.step()")
    if schedule.asynchronous and (optimizer is None or not callable(optimizer)):
        raise TypeError("an asynchronous schedule updates each stage's weights during the step: pass "
                        "optimizer=<callable(params) -> torch.optim.Optimizer>, e.g. lambda ps: torch.optim.SGD(ps, lr=0.1)")
    splits = [kind is Kind.I for kind in schedule.gradient_kind]
    if schedule.asynchronous and any(splits):
        raise ValueError("an asynchronous schedule with W actions: weight stashing runs whole backwards only")

    def stash(module: nn.Module) -> WeightStash | None:
        return WeightStash(module, optimizer, schedule.update_every) if schedule.asynchronous else None

    return {s: StageWorker(s, partition.stages[s], partition.bounds[s], schedule.n_stages, loss_fn, checkpoint[s],
                           device_of(s), rank=rank, splits_backward=splits[s], stash=stash(partition.stages[s]),
                           fused_accumulation=fused_accumulation)
            for s in stages}


def batch_size(inputs: Any, targets: Any) -> int:
    """The samples in one step's batch, the same in its inputs and its targets."""
    total = microbatch.batch_size(inputs)
    if microbatch.batch_size(targets) != total:
        raise ValueError(f"inputs hold {total} samples but targets hold {microbatch.batch_size(targets)}")
    return total


def cut_batch(inputs: Any, targets: Any, n_microbatches: int, asynchronous: bool) -> tuple[list, list, list[float]]:
    """(input chunks, target chunks, loss weights) of one step's batch (module docstring)."""
    total = batch_size(inputs, targets)
    weights = [size / total for size in microbatch.sizes(total, n_microbatches)]
    if asynchronous:  # each micro-batch is one of PipeDream's minibatches: its own mean loss
        weights = [1.0] * n_microbatches
    return microbatch.split(inputs, n_microbatches), microbatch.split(targets, n_microbatches), weights


def step_loss(weights: list[float], losses: list[float], asynchronous: bool) -> float:
    """The step's loss: Σ_i w_i · loss_i (the batch mean), or the minibatches' mean when asynchronous."""
    return sum(w * loss for w, loss in zip(weights, losses)) / (len(losses) if asynchronous else 1)
