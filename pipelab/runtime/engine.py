"""What every engine offers, written once: `Engine`, the base of `pl.Pipeline` and `pl.DistributedPipeline`.

An engine is a step driver (`runtime/driver.py`) over a placement; its methods hand over to
them.  The façades (`local.py`, `distributed.py`) only read their keywords into options and a
placement, and add what belongs to one placement (restaging the local one; gathering the
gradients and counting the communication of ranks).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .checkpoints import checkpoint
from .driver import StepDriver
from .options import PipelineOptions
from .step import GenerationResult, InferenceResult, StepResult


class Engine:
    """A pipeline: `step`, `evaluate`, `infer`, `generate`, its parameters, clipping and checkpoints."""

    group = None  # the process group (None: one process)

    def _start(self, model: nn.Module, options: PipelineOptions, placement) -> None:
        self.model, self.options, self.placement = model, options, placement
        self.driver = driver = StepDriver(model, options, placement)
        self.partition, self.schedule, self.workers = driver.partition, driver.schedule, driver.workers
        self.n_stages, self.n_microbatches, self.loss_fn = driver.n_stages, driver.n_microbatches, options.loss_fn
        self.plan = driver.plan  # split_method="auto" / schedule="auto": every candidate priced, the choice first

    def step(self, inputs: Any, targets: Any = None) -> StepResult:
        """One training step (on ranks: call it on every rank with the same whole batch).  Gradients of the mean
        loss over the batch are *added* to `.grad` (zero them first), on this process's parameters.  `targets`
        go to `loss_fn`; None when the model takes its labels in `inputs` and `loss_fn` is None.

        The result holds the loss and the step's Trace (on ranks: the same on every rank, "measured"; one
        process: "replayed" on one clock per device, or "measured" with one GPU per stage).  With an
        asynchronous schedule, one PipeDream run instead: micro-batch i is minibatch i, the stages' optimizers
        update the weights during it; `loss` is the mean of the minibatches' losses, each taken before its own
        update (`microbatch_losses`)."""
        return self.driver.step(inputs, targets)

    def evaluate(self, inputs: Any, targets: Any = None) -> float:
        """The loss on a held-out batch, forward only (no gradient, nothing kept for a backward): the micro-batches'
        losses weighed as a step weighs them, so it is the model's loss on the whole batch."""
        return self.driver.evaluate(inputs, targets)

    def infer(self, inputs: Any) -> InferenceResult:
        """Forward only, pipelined (inference): the batch cut into the pipeline's m micro-batches, each through
        every stage once under `torch.no_grad()` (E actions, `pl.schedules.forward_only_like` of this pipeline's
        schedule); nothing kept for a backward, nothing sent back.  Returns the last stage's outputs merged in
        order (what `model(inputs)` returns; on ranks, on the last stage's rank, None elsewhere) and the Trace,
        whose `latencies` and `throughput` give each micro-batch's time in the pipeline and micro-batches per
        second.  The model's mode is yours to set (`model.eval()` for dropout and BatchNorm)."""
        return self.driver.infer(inputs)

    def generate(self, prompts: torch.Tensor, new_tokens: int, lanes: int | None = None) -> GenerationResult:
        """Greedy generation through this pipeline's stages (a `pl.models.tiny_gpt`): `lanes` groups of prompts in
        flight (default: the pipeline's m), each with its own key/value cache on every stage, one token per lane
        per round (G actions, `pl.schedules.generation`).  Returns the prompts with their new tokens (the single
        device's greedy text; on ranks, on every rank) and the Trace; `tokens_per_second`."""
        return self.driver.generate(prompts, new_tokens, lanes)

    def parameters(self) -> list[nn.Parameter]:
        """This process's parameters, each once (give them to the optimizer).  A parameter two stages use (a
        tied embedding) is one tensor in one process, its gradient the sum of both uses; on ranks each rank
        that uses it holds a copy, kept equal (DTensors under tensor parallelism)."""
        return self.placement.parameters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients by their global norm over the whole model, as `torch.nn.utils.clip_grad_norm_` on
        the single-device model: every stage and rank, tensor-parallel shards combined, data-parallel replicas
        and a parameter several ranks hold counted once (`runtime/clipping.py`; on ranks call it on every rank).
        Returns the norm before clipping."""
        return self.placement.clip_grad_norm_(max_norm, norm_type)

    def save_checkpoint(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                        overwrite: bool = False, extra: dict | None = None) -> None:
        """Save the model's parameters this process holds (and `optimizer`'s state, and `extra`) with
        torch.distributed.checkpoint (on ranks call it on every rank).  The checkpoint appears at `path` whole,
        once every rank's share is written, or not at all; an existing one is replaced only with
        `overwrite=True` (`runtime/checkpoints/checkpoint.py`).  Any layout reads it back: `load_checkpoint` on a
        pipeline of another depth or engine, or `pl.distributed.load_checkpoint(model, path, optimizer)` into
        one plain model."""
        checkpoint.save(self, path, optimizer, overwrite=overwrite, extra=extra)

    def load_checkpoint(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                        extra: dict | None = None) -> None:
        """Load this process's parameters (and `optimizer`'s state for them, and `extra` in place) from `path`;
        on ranks call it on every rank."""
        checkpoint.load(self, path, optimizer, extra=extra)
