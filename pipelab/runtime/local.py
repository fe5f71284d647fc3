"""The local engine: run any valid Schedule in one process, on GPUs or on the CPU.

`pl.Pipeline` is a façade: it builds the options (`runtime/options.py`) and a
`LocalPlacement` (every stage here, one device each: `runtime/placement.py`), and the step
driver (`runtime/driver.py`) does the rest, as for every engine.  "Sending" is a copy to the next
stage's device.  With one CUDA device per stage, CUDA events time each action ("measured");
when stages share a device, the measured durations are replayed on one virtual clock per
stage ("replayed").  The trace holds the "counted" and "observed" memory curves
(`runtime/memory_observer.py`), plus on CUDA "allocated" and "allocated_peak".

Details: docs/engines.md, "Replayed and measured".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..model.partition import Partition
from ..schedules.schedule import Schedule
from .driver import StepDriver
from .options import LocalPlacementArgs, PipelineOptions, engine_signature
from .placement import LocalPlacement
from .step import GenerationResult, InferenceResult, StepResult


class Pipeline:
    """Pipeline-parallel training of a model on local devices: an `nn.Sequential`, or any module with split_points.

    `pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=nn.MSELoss())`.  Everything after
    `model` is a keyword: `n_stages` and `devices` say where the stages run; every other keyword is an option that
    `pl.DistributedPipeline` takes too, documented once in `pl.PipelineOptions` (or give `options=` whole).

    Args:
        model: an `nn.Sequential` of blocks (see `pl.models`), or any module with `split_points`; its parameters
            receive the gradients.
        n_stages: p.
        devices: "auto", "cpu", "cuda", a device name, or a list with one device per stage.
        options: a `pl.PipelineOptions`; the keywords given beside it replace its fields.
        **settings: the options, by name (`pl.PipelineOptions`): n_microbatches, schedule, loss_fn, ...
    """

    def __init__(self, model: nn.Module, *, options: PipelineOptions | None = None, **settings: Any):
        self.options, where = PipelineOptions.build("Pipeline", LocalPlacementArgs, options, settings)
        self.model, self.requested_devices = model, where.devices
        self.driver = StepDriver(model, self.options, LocalPlacement(self.options, where.n_stages, where.devices))
        self.partition, self.schedule, self.workers = self.driver.partition, self.driver.schedule, self.driver.workers
        self.n_stages, self.n_microbatches = self.driver.n_stages, self.driver.n_microbatches
        self.devices, self.threads = self.driver.placement.devices, self.options.threads
        self.loss_fn = self.options.loss_fn

    def restage(self, n_stages: int, schedule: str | Schedule | None = None, devices: Any = None) -> None:
        """Cut the same model into `n_stages` stages between two steps (devices came or went): the same
        parameters, their `.grad` and so any optimizer over them go on as before, so training continues as
        if uninterrupted.  `schedule`: for the new depth (default: this one's name, e.g. "1f1b"); `devices`:
        for the new stages (default: as before, when that was a name like "cpu")."""
        if schedule is None:
            if not isinstance(self.options.schedule, str):
                raise ValueError("this pipeline runs a hand-made Schedule: give restage(n, schedule=...) for the "
                                 f"new depth of {n_stages} stages")
            schedule = self.options.schedule
        if devices is None:
            if not isinstance(self.requested_devices, str):
                raise ValueError("this pipeline has one device per stage: give restage(n, devices=[...]) with "
                                 f"one for each of the {n_stages} new stages")
            devices = self.requested_devices
        if isinstance(self.options.split_method, Partition):
            raise ValueError("this pipeline was given a Partition: build a new one for the new depth")
        self.__init__(self.model, n_stages=n_stages, devices=devices,
                      options=dataclasses.replace(self.options, schedule=schedule))

    def parameters(self) -> list[nn.Parameter]:
        """Every stage's parameters, in stage order, each once (a tied embedding two stages use: one parameter,
        its gradient the sum of both uses); give them to the optimizer."""
        return self.driver.placement.parameters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients by their global norm over every stage: `torch.nn.utils.clip_grad_norm_` on the
        model's parameters (they all live in this process).  Returns the norm before clipping."""
        return self.driver.placement.clip_grad_norm_(max_norm, norm_type)

    def step(self, inputs: Any, targets: Any = None) -> StepResult:
        """One training step: gradients of the mean loss over the batch are *added* to `.grad` (zero them first).
        `targets` go to `loss_fn`; None when the model takes its labels in `inputs` and `loss_fn` is None.

        With an asynchronous schedule, one PipeDream run instead: micro-batch i is minibatch i, the stages'
        optimizers update the weights during it; `loss` is the mean of the minibatches' losses, each taken
        before its own update (`microbatch_losses`)."""
        return self.driver.step(inputs, targets)

    def infer(self, inputs: Any) -> InferenceResult:
        """Forward only, pipelined (inference): the batch cut into the pipeline's m micro-batches, each through
        every stage once under `torch.no_grad()` (E actions, `pl.schedules.forward_only_like` of this pipeline's
        schedule: the same stages on the same devices); nothing kept for a backward, nothing sent back.
        Returns the last stage's outputs merged in order (what `model(inputs)` returns) and the Trace, whose
        `latencies` and `throughput` give each micro-batch's time in the pipeline and micro-batches per second.
        The model's mode is yours to set (`model.eval()` for dropout and BatchNorm)."""
        return self.driver.infer(inputs)

    def generate(self, prompts: torch.Tensor, new_tokens: int, lanes: int | None = None) -> GenerationResult:
        """Greedy generation through this pipeline's stages (a `pl.models.tiny_gpt`): `lanes` groups of prompts in
        flight (default: the pipeline's m), each with its own key/value cache on every stage, one token per lane
        per round (G actions, `pl.schedules.generation`).  Returns the prompts with their new tokens (the single
        device's greedy text) and the Trace; `tokens_per_second`."""
        return self.driver.generate(prompts, new_tokens, lanes)


Pipeline.__init__.__signature__ = engine_signature(LocalPlacementArgs)
