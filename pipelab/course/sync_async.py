"""Synchronous 1F1B beside asynchronous PipeDream: the same minibatches, trained and timed both ways (lesson 10).

- `flushed_1f1b(p, m, n_steps)`: n_steps synchronous 1F1B steps back to back as one table;
  makespan n_steps (m + p - 1)(t_F + t_B) at uniform costs (PipeDream-2BW §3.2; GPipe §2.3).
- `train_flushed(...)`: synchronous training on the local engine, one 1F1B step of m
  micro-batches per minibatch, then every stage's optimizer steps once.
- `update_times(trace, microbatches_per_update)`: the simulated time at which each update is
  complete (the end of stage 0's backward of the update's last micro-batch): at uniform costs
  (p + i)(t_F + t_B) for PipeDream's i-th minibatch, (k + 1)(m + p - 1)(t_F + t_B) for the
  k-th flushed step.

Details (why no barrier is needed, why that is when an update is complete): docs/course.md,
"Lesson 10: synchronous and asynchronous".
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..common.checks import check_counts
from ..runtime.local import Pipeline
from ..schedules import one_f_one_b
from ..schedules.action import RELEASING_KINDS, Action
from ..schedules.schedule import Schedule
from ..schedules.trace import Trace


def flushed_1f1b(n_stages: int, n_microbatches: int, n_steps: int) -> Schedule:
    """`n_steps` 1F1B steps of `n_microbatches` each, one after the other (a flush between steps).

    p=2, m=2, 2 steps (micro-batches 2 and 3 are the second step's 0 and 1):

        device 0 | F0 F1 .  B0 .  B1 F2 F3 .  B2 .  B3
        device 1 | .  F0 B0 F1 B1 .  .  F2 B2 F3 B3 .
    """
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches, n_steps=n_steps)
    one = one_f_one_b(n_stages, n_microbatches)
    rows = [[Action(a.kind, a.stage, a.microbatch + k * n_microbatches) for k in range(n_steps) for a in row]
            for row in one.actions]
    return Schedule(n_stages, n_microbatches * n_steps, rows, name=f"1f1b, {n_steps} flushed steps",
                    meta={"microbatches_per_step": n_microbatches})


def train_flushed(model: torch.nn.Module, n_stages: int, n_microbatches: int, inputs: list[Any],
                  targets: list[Any], loss_fn: Callable,
                  make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> list[float]:
    """Train on each (inputs[k], targets[k]) minibatch with one synchronous 1F1B step; return each step's loss.

    `model` is trained in place; `make_optimizer(params)` builds one optimizer per stage.
    """
    if len(inputs) != len(targets) or not inputs:
        raise ValueError(f"give as many input as target minibatches, and at least one; got {len(inputs)} and "
                         f"{len(targets)}")
    pipe = Pipeline(model, n_stages=n_stages, n_microbatches=n_microbatches, schedule="1f1b", loss_fn=loss_fn,
                    devices="cpu")
    optimizers = [make_optimizer(list(stage.parameters())) for stage in pipe.partition.stages]
    losses = []
    for x, y in zip(inputs, targets):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y).loss)
        for optimizer in optimizers:
            optimizer.step()
    return losses


def update_times(trace: Trace, microbatches_per_update: int = 1) -> list[float]:
    """When each update is complete: the end of stage 0's B of every `microbatches_per_update`-th micro-batch."""
    check_counts(microbatches_per_update=microbatches_per_update)
    ends = {e.microbatch: e.end for e in trace.events if e.stage == 0 and e.kind in RELEASING_KINDS}
    if not ends or sorted(ends) != list(range(len(ends))):
        raise ValueError("the trace needs stage 0's backward of every micro-batch 0, 1, 2, ...")
    if len(ends) % microbatches_per_update:
        raise ValueError(f"{len(ends)} micro-batches do not make whole updates of {microbatches_per_update}")
    return [ends[i] for i in range(microbatches_per_update - 1, len(ends), microbatches_per_update)]
