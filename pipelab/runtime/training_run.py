"""A training run over real data: `pl.train(pipe, loader, optimizer, epochs=2, clip=1.0, ...)`.

The loop every training script writes, for a pipeline of either engine:

    for epoch in epochs:                      # the data's order seeded per epoch (seed + epoch)
        for batch in batches:                 # any iterable: a DataLoader with a padding collator
            optimizer.zero_grad(); result = pipe.step(batch)
            pipe.clip_grad_norm_(clip); optimizer.step(); scheduler.step()
            every eval_every steps: pipe.evaluate(...) over the held-out batches (forward only)
            every checkpoint_every steps: a checkpoint (runtime/checkpoints/folder.py)

A batch is a dict (the model's keyword arguments, labels included: Hugging Face's collators) or a
(inputs, targets) pair.  Batches may change size and length from step to step (a partial last
batch, dynamic padding): every step is still the single device's (docs/your_model.md).

Resuming: a checkpoint holds the model, the optimizer, the scheduler, where the run was (epoch,
batches done in it, steps) and the random state.  A run started again with the same folder loads
the newest (`CheckpointFolder.resume`: a damaged one set aside), seeds the epoch as before so the
loader gives the same order, skips the batches done, puts back the random state (dropout), and
goes on: its losses are the uninterrupted run's.  (The loader must give the same batches for the
same seed: a `DataLoader` with `shuffle=True` draws its order from torch's random state when an
epoch starts, which is what the seed sets.)

Why a function and not a `Trainer` class: it is the loop a learner would write, in one screen, and
what it needs is plain objects (a pipeline, a loader, an optimizer, a scheduler) the learner
already has; torchtitan's `train.py` and nanoGPT keep the same loop in the open.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Iterable

import torch
from tqdm.auto import tqdm

from ..model import microbatch
from ..model.token_weights import counter_for
from .checkpoints.folder import CheckpointFolder


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """How `pl.train` runs.

    Attributes:
        epochs: passes over `batches`.
        clip: the largest global gradient norm (`pipe.clip_grad_norm_`); None: no clipping.
        scheduler: a learning-rate scheduler, stepped after every optimizer step.
        held_out: batches to evaluate on (forward only, `pipe.evaluate`), every `eval_every` steps and at the end.
        eval_every: steps between evaluations (None: at the end only).
        checkpoint_dir: a folder for numbered checkpoints (every rank sees it); a run given one resumes from its
            newest checkpoint.
        checkpoint_every: steps between checkpoints (and one at the end).
        seed: each epoch begins with `torch.manual_seed(seed + epoch)`, so its data order and random state are
            the same when the run is resumed; None leaves torch's random state alone (no exact resume).
        max_steps: stop after this many steps in all (None: run every epoch).
        progress: a tqdm bar (on ranks, on rank 0).
    """

    epochs: int = 1
    clip: float | None = None
    scheduler: Any = None
    held_out: Iterable | None = None
    eval_every: int | None = None
    checkpoint_dir: Any = None
    checkpoint_every: int | None = None
    seed: int | None = 0
    max_steps: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "eval_every", "checkpoint_every", "max_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int{'' if name == 'epochs' else ' or None'}, got {value!r}")
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise ValueError(f"clip must be a positive number (the largest gradient norm) or None, got {self.clip!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir=<a folder every rank sees>")


@dataclasses.dataclass
class TrainingRun:
    """What a run did: every step's loss (in order, those of a resumed run's earlier part included), the held-out
    losses by step, and the last step's result (its trace)."""

    losses: list[float]
    eval_losses: dict[int, float]
    steps: int  # steps done in all
    epochs_done: int
    resumed_from: int  # steps the run found in its checkpoint (0: started afresh)
    seconds: float  # this process's time in this call
    last: Any = None  # the last StepResult of this call

    @property
    def final_eval_loss(self) -> float | None:
        return self.eval_losses[max(self.eval_losses)] if self.eval_losses else None


@dataclasses.dataclass
class _Place:
    """Where a run is: what a checkpoint saves besides the model and the optimizer."""

    epoch: int = 0
    batch: int = 0  # batches of `epoch` done
    steps: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)
    eval_losses: dict[int, float] = dataclasses.field(default_factory=dict)

    def extra(self, scheduler) -> dict:
        place = {"epoch": self.epoch, "batch": self.batch, "steps": self.steps, "losses": self.losses,
                 "eval_losses": {str(k): v for k, v in self.eval_losses.items()}}
        return {"place": json.dumps(place), "rng": torch.get_rng_state(),
                "scheduler": json.dumps(None if scheduler is None else _jsonable(scheduler.state_dict()))}

    @staticmethod
    def template() -> dict:
        return {"place": "", "rng": torch.empty_like(torch.get_rng_state()), "scheduler": ""}

    @classmethod
    def read(cls, extra: dict, scheduler) -> "_Place":
        place = json.loads(extra["place"])
        if scheduler is not None and json.loads(extra["scheduler"]) is not None:
            scheduler.load_state_dict(json.loads(extra["scheduler"]))
        return cls(place["epoch"], place["batch"], place["steps"], place["losses"],
                   {int(k): v for k, v in place["eval_losses"].items()})


def _jsonable(state: dict) -> dict:
    """A scheduler's state dict without what JSON cannot hold (a lambda of LambdaLR: rebuilt by the caller)."""
    return {k: v for k, v in state.items() if isinstance(v, (int, float, str, bool, list, dict, type(None)))}


def as_step_arguments(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of one batch: a dict is the model's keyword arguments (targets None, labels inside); a
    pair is (inputs, targets)."""
    if isinstance(batch, dict):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"a batch is a dict of the model's keyword arguments or an (inputs, targets) pair, got "
                    f"{type(batch).__name__}{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}")


def train(pipe, batches: Iterable, optimizer: torch.optim.Optimizer, options: TrainOptions | None = None,
          **settings: Any) -> TrainingRun:
    """Train `pipe` (a `pl.Pipeline` or `pl.DistributedPipeline`, on every rank) over `batches` with
    `optimizer` (over `pipe.parameters()`); `settings` are `TrainOptions`' fields (module docstring)."""
    options = dataclasses.replace(options or TrainOptions(), **settings) if settings else (options or TrainOptions())
    folder = None if options.checkpoint_dir is None else CheckpointFolder(options.checkpoint_dir)
    begin, place, resumed = time.perf_counter(), _Place(), 0
    rng = None
    if folder is not None:
        extra = _Place.template()
        resumed = folder.resume(pipe, optimizer, extra)
        if resumed:
            place, rng = _Place.read(extra, options.scheduler), extra["rng"]
    bar = _bar(pipe, options, batches, place.steps)
    last = None
    while place.epoch < options.epochs and not _done(options, place):
        epoch, skip = place.epoch, place.batch  # batches of this epoch done before the run stopped
        if options.seed is not None:
            torch.manual_seed(options.seed + epoch)
        for k, batch in enumerate(batches):
            if k < skip:
                continue
            if rng is not None:  # the random state the checkpoint saved: dropout goes on as it would have
                torch.set_rng_state(rng)
                rng = None
            last = _one_step(pipe, optimizer, options, batch, place)
            bar.update(1)
            bar.set_postfix(loss=f"{last.loss:.4f}", epoch=epoch)
            _after_step(pipe, optimizer, options, folder, place)
            if _done(options, place):
                break
        else:
            place.epoch, place.batch, rng = epoch + 1, 0, None  # (a new epoch's random state: from its seed)
    bar.close()
    _finish(pipe, optimizer, options, folder, place)
    return TrainingRun(place.losses, place.eval_losses, place.steps, place.epoch, resumed,
                       time.perf_counter() - begin, last)


def _done(options: TrainOptions, place: _Place) -> bool:
    return options.max_steps is not None and place.steps >= options.max_steps


def _one_step(pipe, optimizer, options: TrainOptions, batch: Any, place: _Place):
    """One step: every gradient of the pipeline cleared (a frozen parameter's old one included: it would count in
    the clipping norm), the step, clipping, the optimizer and the scheduler, these three on the pipeline's own
    intra-op threads (PyTorch's default of one per core collapses when the ranks share the cores)."""
    inputs, targets = as_step_arguments(batch)
    optimizer.zero_grad(set_to_none=True)
    for p in pipe.parameters():
        p.grad = None
    result = pipe.step(inputs, targets)
    with pipe.placement.context():
        if options.clip is not None:
            pipe.clip_grad_norm_(options.clip)
        optimizer.step()
        if options.scheduler is not None:
            options.scheduler.step()
    place.batch += 1
    place.steps += 1
    place.losses.append(result.loss)
    return result


def _after_step(pipe, optimizer, options: TrainOptions, folder, place: _Place) -> None:
    if options.eval_every is not None and options.held_out is not None and place.steps % options.eval_every == 0:
        place.eval_losses[place.steps] = evaluate(pipe, options.held_out)
    if folder is not None and options.checkpoint_every is not None and place.steps % options.checkpoint_every == 0:
        folder.save(pipe, optimizer, place.steps, place.extra(options.scheduler))


def _finish(pipe, optimizer, options: TrainOptions, folder, place: _Place) -> None:
    """The held-out loss and a checkpoint at the end, where the last step did not make them."""
    if options.held_out is not None and place.steps and place.steps not in place.eval_losses:
        place.eval_losses[place.steps] = evaluate(pipe, options.held_out)
    if folder is not None and place.steps:
        newest = folder.newest()
        if newest is None or newest[0] != place.steps:
            folder.save(pipe, optimizer, place.steps, place.extra(options.scheduler))


def evaluate(pipe, batches: Iterable) -> float:
    """The mean held-out loss over `batches`, each batch's loss weighed by its counted tokens where the pipeline
    counts tokens (its own loss with padding), else by its samples: the loss of all of them as one batch."""
    total, weight = 0.0, 0.0
    for batch in batches:
        inputs, targets = as_step_arguments(batch)
        size = _batch_weight(pipe, inputs, targets)
        total += pipe.evaluate(inputs, targets) * size
        weight += size
    return total / weight if weight else math.nan


def _batch_weight(pipe, inputs: Any, targets: Any) -> float:
    count = counter_for(pipe.driver.count_tokens, inputs, targets)
    return float(count(inputs, targets)) if count is not None else float(microbatch.batch_size(inputs))


def _bar(pipe, options: TrainOptions, batches: Iterable, done: int):
    try:
        total = options.epochs * len(batches)
    except TypeError:  # an iterable without a length
        total = None
    if options.max_steps is not None:
        total = min(total, options.max_steps) if total is not None else options.max_steps
    lead = pipe.group is None or torch.distributed.get_rank(pipe.group) == 0
    return tqdm(total=total, initial=done, unit="step", disable=not (options.progress and lead),
                desc=f"{pipe.schedule.name} p={pipe.n_stages} m={pipe.n_microbatches}")

