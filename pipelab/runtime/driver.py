"""One step, written once: the driver every engine runs, for training, inference and generation.

    step(x, y):  cut the batch and weigh its micro-batches -> check the memory limit (first step)
                 -> warm up (first step) -> run this process's actions through the loop -> the rows of
                 every action -> StepResult (its Trace built when first read)
    infer(x):    the same with the schedule's forward-only twin (E actions), under no_grad
    generate:    the same with a generation schedule (G actions, `schedules.generation`)

Everything that depends on where the stages run (which ones are here, their devices, the
transport, the order of the actions, how every action's row reaches this process) is asked of
the placement (`runtime/placement.py`: `LocalPlacement`, `RankPlacement`).  The per-action loop
is `runtime/loop.py`, the Trace is `runtime/trace_builder.py`; the warm-up is a one-micro-batch
schedule of the same stages and profiles (`schedules/warm_up.py`) run through that loop.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch import nn

from ..model import loss_check, microbatch
from ..model import stage as stage_ops
from ..model.batch_norm import warn_if_batch_norm, warn_if_router_loss
from ..model.finite import FiniteChecks
from ..model.kv_cache import check_prompts
from ..model.token_weights import counter_for, ignored_labels, token_counter
from ..predict.budget import check_limit
from ..predict.memory import checkpoint_plan
from ..schedules.inference import forward_only_like, generation
from ..schedules.schedule import Schedule
from ..schedules.warm_up import warm_up_like
from . import engine_costs
from .auto_choice import wants_decision
from .clock import ActionClock
from .loop import run_actions
from .memory_observer import MemoryObserver
from .options import PipelineOptions
from .placement import Placement
from .step import (
    GenerationResult,
    InferenceResult,
    StepResult,
    batch_size,
    check_generation,
    check_loss_fn,
    check_traced,
    cut_batch,
    merged_outputs,
    step_loss,
)
from .trace_builder import build_trace, durations, losses


class StepDriver:
    """A pipeline's schedule, stages and workers, and the step, inference pass and generation that run them."""

    def __init__(self, model: nn.Module, options: PipelineOptions, placement: Placement):
        self.model, self.options, self.placement = model, options, placement
        check_loss_fn(options.loss_fn, traced=options.traced or not isinstance(model, nn.Sequential))
        self.count_tokens = token_counter(model, options.loss_fn, options.loss_normalization)  # None: by samples
        self.finite_checks = FiniteChecks(options.check_finite)
        self.plan = None  # what split_method="auto" / schedule="auto" decided (`runtime/auto_choice.py`)
        if wants_decision(options):
            with placement.context():  # the engine's own costs, measured on a twin placement over tiny blocks
                engine = lambda n, families: engine_costs.measure(  # noqa: E731
                    lambda m, o: StepDriver(m, o, placement.twin(o)), n, families)
                self.plan, options = placement.decide(model, engine)
            self.options = options
        self.schedule = placement.resolve_schedule()
        self.n_stages, self.n_microbatches = self.schedule.n_stages, options.n_microbatches
        self.asynchronous = self.schedule.asynchronous
        self.checkpoint = checkpoint_plan(options.checkpoint, self.n_stages)
        self.memory_limits = (None if options.memory_limit_bytes is None
                              else check_limit(options.memory_limit_bytes, self.schedule.n_devices))
        self.memory_optimizer = options.optimizer if options.optimizer is not None else options.memory_optimizer
        self.activation_budgets: dict[int, float] | None = None  # set by the first step's memory check
        with placement.context():
            self.partition, self.workers = placement.build(model, self.schedule, self.checkpoint)
        self.forward_schedule = forward_only_like(self.schedule)
        self.warmed_up = {"train": not options.warm_up, "forward": not options.warm_up}
        self.warned_samples = False  # "samples" meeting -100 labels: said once
        self.smaller_schedules: dict[int, Schedule] = {}  # batch size < m -> the schedule for it
        self.smaller_forward: dict[int, Schedule] = {}  # and its forward-only twin

    # -- training --------------------------------------------------------------------------
    def step(self, inputs: Any, targets: Any = None) -> StepResult:
        warn_if_batch_norm(self.model, self.n_microbatches)
        warn_if_router_loss(self.model, self.n_microbatches)
        placement = self.placement
        with placement.context(), self.finite_checks.step(), loss_check.usage_errors():
            count_tokens = counter_for(self.count_tokens, inputs, targets)
            inputs, targets, weight = placement.share(inputs, targets, count_tokens)
            schedule = self._schedule_for(batch_size(inputs, targets))
            chunks, target_chunks, weights = cut_batch(inputs, targets, schedule.n_microbatches, self.asynchronous,
                                                       count_tokens)
            self._warn_if_samples_meet_ignored_labels(inputs, targets, count_tokens)
            check_traced(self.partition, self.model, chunks)
            if self.memory_limits is not None and self.activation_budgets is None:
                self.activation_budgets = placement.activation_budgets(self, chunks[0], target_chunks[0])
            if not self.warmed_up["train"]:
                self._warm_up(schedule, chunks[0], target_chunks[0])
                self.warmed_up["train"] = True
            rows, wall_seconds, place_observed = self._run(schedule, chunks, target_chunks, weights)
            found = losses(schedule, rows)
            labels = placement.trace_labels()
            op_seconds = sum(durations(rows, labels["replayed"]).values())
            result = StepResult(step_loss(weights, found, self.asynchronous), found, wall_seconds, op_seconds,
                                lambda: build_trace(schedule, rows, place_observed, **labels))
            return placement.combine(result, weight)

    def _schedule_for(self, n_samples: int) -> Schedule:
        """The pipeline's schedule, or for a batch smaller than m (an epoch's partial last batch) the same named
        schedule for one micro-batch per sample (made once per size)."""
        if n_samples >= self.n_microbatches:
            return self.schedule
        if not isinstance(self.options.schedule, str) or self.asynchronous:
            raise ValueError(f"a batch of {n_samples} samples cannot fill the schedule's {self.n_microbatches} "
                             "micro-batches, and this pipeline runs a hand-made or asynchronous schedule that "
                             "pipelab cannot rebuild for fewer: drop the epoch's partial last batch "
                             "(DataLoader(..., drop_last=True)) or give batches of at least "
                             f"{self.n_microbatches} samples")
        if n_samples not in self.smaller_schedules:
            self.smaller_schedules[n_samples] = self.placement.resolve_schedule(n_samples)
            warnings.warn(f"a batch of {n_samples} samples, fewer than the pipeline's {self.n_microbatches} "
                          f"micro-batches: it runs as {n_samples} micro-batches of one sample ("
                          f"{self.options.schedule} rebuilt for m = {n_samples}; its loss and gradients are still "
                          "the whole batch's); said once per size", stacklevel=3)
        return self.smaller_schedules[n_samples]

    def _warn_if_samples_meet_ignored_labels(self, inputs: Any, targets: Any, count_tokens) -> None:
        """Weighing micro-batches by samples is not the full batch's mean over counted tokens: say so, once."""
        if count_tokens is not None or self.warned_samples or self.asynchronous:
            return
        if ignored_labels(inputs, targets, self.options.loss_fn):
            self.warned_samples = True
            warnings.warn('loss_normalization="samples" weighs each micro-batch by its samples, but the labels hold '
                          "-100 (tokens left out of a token-mean loss): the step is then not the full batch's mean "
                          'loss; loss_normalization="tokens" (or "auto") weighs them by counted tokens, exactly',
                          stacklevel=3)

    # -- forward only ----------------------------------------------------------------------
    def evaluate(self, inputs: Any, targets: Any = None) -> float:
        """The batch's loss, forward only: each micro-batch's loss weighed as in a step."""
        self.placement.check_plain("evaluate")
        with self.placement.context(), torch.no_grad(), loss_check.usage_errors():
            count_tokens = counter_for(self.count_tokens, inputs, targets)
            inputs, targets, _ = self.placement.share(inputs, targets, count_tokens)
            schedule = self._forward_for(batch_size(inputs, targets))
            chunks, target_chunks, weights = cut_batch(inputs, targets, schedule.n_microbatches, False, count_tokens)
            check_traced(self.partition, self.model, chunks)
            if not self.warmed_up["forward"]:
                self._warm_up(schedule, chunks[0], None)
                self.warmed_up["forward"] = True
            rows, _, _ = self._run(schedule, chunks, target_chunks, weights, evaluating=True)
        return step_loss(weights, losses(schedule, rows), False)

    def _forward_for(self, n_samples: int) -> Schedule:
        """The forward-only twin of `_schedule_for(n_samples)` (made once per size)."""
        training = self._schedule_for(n_samples)
        if training is self.schedule:
            return self.forward_schedule
        if n_samples not in self.smaller_forward:
            self.smaller_forward[n_samples] = forward_only_like(training)
        return self.smaller_forward[n_samples]

    def infer(self, inputs: Any) -> InferenceResult:
        self.placement.check_plain("infer")
        schedule = self._forward_for(microbatch.batch_size(inputs))
        with self.placement.context(), torch.no_grad():
            chunks = microbatch.split(inputs, schedule.n_microbatches)
            check_traced(self.partition, self.model, chunks)
            if not self.warmed_up["forward"]:
                self._warm_up(schedule, chunks[0], None)
                self.warmed_up["forward"] = True
            m = len(chunks)
            rows, wall_seconds, place_observed = self._run(schedule, chunks, [None] * m, [1.0] * m)
            trace = build_trace(schedule, rows, place_observed, **self.placement.trace_labels())
        last = self.workers.get(self.n_stages - 1)
        output = None if last is None else merged_outputs([last.outputs[i] for i in range(m)])
        return InferenceResult(output, trace, wall_seconds)

    def generate(self, prompts: torch.Tensor, new_tokens: int, lanes: int | None = None) -> GenerationResult:
        self.placement.check_plain("generate")
        lanes = self.n_microbatches if lanes is None else lanes
        check_generation(prompts, new_tokens, lanes)
        check_prompts(self.partition.stages[0], prompts, new_tokens)
        schedule = generation(self.n_stages, lanes, new_tokens, self.schedule.device_of_stage())
        groups = microbatch.split(prompts, lanes)
        with self.placement.context(), torch.no_grad():
            # a lane's messages have its prompt's length in round 0, one token's after: the transport's shapes
            shapes = [(microbatch.signature(groups[k % lanes]), k < lanes) for k in range(lanes * new_tokens)]
            rows, _, place_observed = self._run(schedule, groups, [None] * lanes, [1.0] * lanes, shapes)
            last = self.workers.get(self.n_stages - 1)
            tokens = None
            if last is not None:
                tokens = torch.cat([torch.cat([group, *(last.outputs[r * lanes + j].to(prompts.device)
                                                        for r in range(new_tokens))], dim=1)
                                    for j, group in enumerate(groups)], dim=0)
            tokens = self.placement.from_last_stage(tokens, prompts.shape[0], prompts.shape[1] + new_tokens)
        trace = build_trace(schedule, rows, place_observed, **self.placement.trace_labels())
        return GenerationResult(tokens.to(prompts.dtype), trace, new_tokens)

    # -- the run itself ----------------------------------------------------------------------
    def _run(self, schedule: Schedule, chunks: list, target_chunks: list, weights: list[float],
             shapes: list | None = None, evaluating: bool = False):
        """Run this process's actions of `schedule` on `chunks`; every action's row, this process's seconds, and the
        observed memory's placing.  `shapes[i]`: what sets the shapes of micro-batch i's messages (default: its
        chunk's `microbatch.signature`)."""
        placement = self.placement
        observer = MemoryObserver(schedule.device_of_stage(), placement.parameters(), self.activation_budgets)
        for worker in self.workers.values():
            worker.start_step(chunks, target_chunks, weights, observer, evaluating)
        shapes = [microbatch.signature(chunk) for chunk in chunks] if shapes is None else shapes
        transport = placement.transport(schedule, observer, shapes)
        clock = ActionClock(placement.devices)
        begin = time.perf_counter()
        with placement.running(schedule):
            run_actions(schedule, placement.order(schedule), self.workers, transport, clock, observer)
            placement.finish(schedule, transport, training=not schedule.forward_only)
        observer.close()
        rows, place_observed = placement.gather(schedule, clock, observer, transport, self.workers)
        return rows, time.perf_counter() - begin, place_observed

    def _warm_up(self, schedule: Schedule, inputs: Any, targets: Any) -> None:
        """One micro-batch of `schedule`'s stages and profiles, untimed (`schedules/warm_up.py`), through the same
        loop and transport: PyTorch initialises kernels lazily, and the first backward of some ops costs hundreds
        of milliseconds.  Nothing it does stays: the gradients are set aside (its own are dropped), BatchNorm's
        statistics and the random state restored, an asynchronous schedule's weight stash not used."""
        warm = warm_up_like(schedule)
        parameters = self.placement.parameters()
        grads = [(p, p.grad) for p in parameters]
        stashes = {s: worker.stash for s, worker in self.workers.items()}
        devices = [d for d in self.placement.devices if d.type == "cuda"]
        try:
            for p in parameters:
                p.grad = None
            for worker in self.workers.values():
                worker.stash = None
                worker.start_step([inputs], [targets], [1.0])
            with stage_ops.buffers_kept(self.model.buffers()), torch.random.fork_rng(devices=devices):
                transport = self.placement.transport(warm, None, [microbatch.signature(inputs)])
                run_actions(warm, self.placement.order(warm), self.workers, transport, ActionClock([]),
                            reporting=False)
                self.placement.finish(warm, transport, training=False)
        finally:
            for s, worker in self.workers.items():
                worker.stash = stashes[s]
            for p, grad in grads:
                p.grad = grad
