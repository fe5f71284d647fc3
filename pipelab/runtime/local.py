"""The local engine: run any valid Schedule in one process, on GPUs or on the CPU.

`Pipeline.step(x, y)` prepares the step as every engine does (`runtime/step.py`), then runs
the schedule's actions in a dependency-respecting order through the loop the distributed
engine runs too (`runtime/loop.py`); "sending" is a copy to the next stage's device
(`InProcessTransport`).  With one CUDA device per stage, CUDA events time each action
("measured"); when stages share a device, the measured durations are replayed on one
virtual clock per stage ("replayed").  The trace holds the "counted" and "observed" memory
curves (`runtime/memory_observer.py`), plus on CUDA "allocated" and "allocated_peak".

Details: docs/engines.md, "Replayed and measured".
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from ..common.threads import check_threads, intra_op_threads
from ..model.partition import Partition
from ..model import stage as stage_ops
from ..model import loss_check, microbatch
from ..model.batch_norm import warn_if_batch_norm
from ..model.finite import FiniteChecks
from ..model.token_weights import token_counter
from ..predict.budget import check_limit, check_memory_budget
from ..predict.costs import Costs
from ..predict.memory import activation_samples, checkpoint_plan
from ..schedules.action import Action, Kind
from ..schedules.dependencies import run_dependencies
from ..schedules.inference import forward_only_like
from ..schedules.schedule import Schedule
from ..schedules.trace import Event, MemorySample, Trace
from .clock import ActionClock
from .devices import assign_devices
from .generation import GenerationResult, generate
from .loop import InProcessTransport, run_actions
from .memory_observer import MemoryObserver, observed_breakdown, observed_samples
from .step import (
    InferenceResult,
    merged_outputs,
    StepResult,
    build_partition,
    check_loss_fn,
    check_shared_devices,
    check_traced,
    check_microbatch_count,
    cut_batch,
    make_workers,
    resolve_schedule,
    step_loss,
    unique_parameters,
)


class Pipeline:
    """Pipeline-parallel training of a model on local devices: an `nn.Sequential`, or any module with split_points.

    Everything after `model` is a keyword, in the same order as `pl.DistributedPipeline`'s.

    Args:
        model: an `nn.Sequential` of blocks (see `pl.models`), or any module with `split_points`; its parameters
            receive the gradients.
        n_stages, n_microbatches: p and m.
        schedule: "gpipe", "1f1b", "zb-h1" or a `Schedule` for the same p and m (validated).  A stage
            with I and W actions splits each backward: I computes the input gradient only, W the weight
            gradients (`pipelab.model.split_backward`), and a micro-batch is held until its W.
        loss_fn: loss(output, target) returning the *mean* over a micro-batch; None for a model split by names
            that computes its own loss (`output.loss`, with labels in the batch).
        loss_normalization: "samples" (micro-batch i counts n_i / N) or "tokens" (c_i / C, its counted tokens:
            labels other than -100; exact for a token-mean loss with padding; `model/token_weights.py`).
        devices: "auto", "cpu", "cuda", a device name, or a list with one device per stage.
        split_method: "uniform", "params", "time" (needs `sample`) or a ready `Partition`.
        split_points: any `nn.Module` instead of an `nn.Sequential`: the names of the modules where stages
            begin (`model/named_split.py`); `sample` is then a whole batch, as the model's keyword arguments.
        sample: an input batch, for split_method="time" and for split_points.
        checkpoint: activation checkpointing per stage: "never", "always", "except_last"
            (the last stage runs B right after F in 1F1B, so recomputing there saves little)
            or a list of booleans, one per stage.
        threads: PyTorch intra-op threads while a step runs (default 1: timings that hold when
            something else uses a core; restored after the step); None keeps the caller's.
        optimizer: for an asynchronous schedule ("pipedream-async", `pl.schedules.pipedream_async`)
            only, and needed there: `optimizer(params)` builds each stage's own optimizer.  A step
            is then a PipeDream run: each micro-batch is one minibatch with its own mean loss and
            update, under the weight-stashing rule of `runtime/weight_stash.py`.
        fused_accumulation: each Linear adds its weight gradient into `.grad` inside its multiply
            instead of computing it and adding it after, one pass over the weights fewer per
            micro-batch (`model/fused_accumulation.py`; default True; not with a split backward
            or weight stashing).  False: plain autograd accumulation.
        warm_up: before the first step, run one micro-batch forward and backward through every
            stage, untimed, its gradients discarded: PyTorch initialises kernels lazily, and the
            first backward of some ops costs hundreds of milliseconds (default True).
        check_finite: NaN and inf in a stage's output or in the loss raise a `PipelineError` naming the
            stage, action and micro-batch where they first appear (`model/finite.py`): "first" checks the
            first step (the default), True every step, False none.  One `isfinite().all()` per stage
            output of a checked step.
        memory_limit_bytes: bytes each device may hold (a number, or one per device; None: no limit).  Before
            the first step each device's parameters, gradients, optimizer state (`memory_optimizer`) and the
            schedule's predicted activations are added up and a step that would not fit is refused, each part
            named (`pl.check_memory_budget`, docs/memory_budget.md); during every step the observed activations
            and messages are held to what the limit leaves (a `MemoryBudgetError` in the action that overran).
        memory_optimizer: the optimizer whose state counts: "adam" (default), "adamw", "sgd", "momentum",
            "mixed-adam" (ZeRO's 16 bytes per parameter), or a torch optimizer (its real state).
    """

    def __init__(self, model: nn.Module, *, n_stages: int, n_microbatches: int, schedule: str | Schedule = "1f1b",
                 loss_fn: Callable | None = None, loss_normalization: str = "samples", devices: Any = "auto",
                 split_method: str | Partition = "uniform", split_points: list[str] | None = None, sample: Any = None,
                 checkpoint: str | list[bool] = "never", threads: int | None = 1, optimizer: Callable | None = None,
                 fused_accumulation: bool = True, warm_up: bool = True, check_finite: bool | str = "first",
                 memory_limit_bytes: float | list[float] | None = None, memory_optimizer: Any = "adam"):
        self.options = {name: value for name, value in locals().items() if name not in ("self", "model")}  # restage
        check_loss_fn(loss_fn, traced=split_points is not None or not isinstance(model, nn.Sequential))
        check_microbatch_count(n_microbatches)
        self.count_tokens = token_counter(model, loss_fn, loss_normalization)  # None: weights by samples
        self.finite_checks = FiniteChecks(check_finite)
        self.threads = check_threads(threads)
        with intra_op_threads(threads):
            self.partition = build_partition(model, n_stages, n_microbatches, split_method, split_points, sample,
                                             threads)
        self.model, self.loss_fn = model, loss_fn
        self.n_stages, self.n_microbatches = n_stages, n_microbatches
        self.schedule = resolve_schedule(schedule, n_microbatches, n_stages=n_stages)
        self.checkpoint = checkpoint_plan(checkpoint, n_stages)
        self.memory_limits = None if memory_limit_bytes is None else check_limit(memory_limit_bytes,
                                                                                self.schedule.n_devices)
        self.memory_optimizer = optimizer if optimizer is not None else memory_optimizer
        self.activation_budgets: dict[int, float] | None = None  # set by the first step's memory check
        where = self.schedule.device_of_stage()
        self.devices = assign_devices(devices, [where[s] for s in range(n_stages)])
        check_shared_devices(self.partition, self.devices)
        for stage, device in zip(self.partition.stages, self.devices):
            stage.to(device)
        self.workers = make_workers(self.schedule, self.partition, list(range(n_stages)), loss_fn, self.checkpoint,
                                    self.devices.__getitem__, optimizer=optimizer,
                                    fused_accumulation=fused_accumulation)
        self.asynchronous = self.schedule.asynchronous
        self.warmed_up = not warm_up  # set once the warm-up has run
        self.warmed_up_forward = not warm_up  # the same for `infer`'s forward-only pass
        self.order = run_dependencies(self.schedule, duration=lambda a: 1.0).time_order()
        device_of_stage = self.schedule.device_of_stage()
        self.wall_clock = (
            all(d.type == "cuda" for d in self.devices) and len(set(self.devices)) == n_stages
            and sorted(device_of_stage.values()) == list(range(n_stages))
        )

    def restage(self, n_stages: int, schedule: str | Schedule | None = None, devices: Any = None) -> None:
        """Cut the same model into `n_stages` stages between two steps (devices came or went): the same
        parameters, their `.grad` and so any optimizer over them go on as before, so training continues as
        if uninterrupted.  `schedule`: for the new depth (default: this one's name, e.g. "1f1b"); `devices`:
        for the new stages (default: as before, when that was a name like "cpu")."""
        if schedule is None:
            if not isinstance(self.options["schedule"], str):
                raise ValueError("this pipeline runs a hand-made Schedule: give restage(n, schedule=...) for the "
                                 f"new depth of {n_stages} stages")
            schedule = self.options["schedule"]
        if devices is None:
            if not isinstance(self.options["devices"], str):
                raise ValueError("this pipeline has one device per stage: give restage(n, devices=[...]) with "
                                 f"one for each of the {n_stages} new stages")
            devices = self.options["devices"]
        if isinstance(self.options["split_method"], Partition):
            raise ValueError("this pipeline was given a Partition: build a new one for the new depth")
        self.__init__(self.model, **{**self.options, "n_stages": n_stages, "schedule": schedule, "devices": devices})

    def parameters(self) -> list[nn.Parameter]:
        """Every stage's parameters, in stage order, each once (a tied embedding two stages use: one parameter,
        its gradient the sum of both uses); give them to the optimizer."""
        return unique_parameters(self.partition.stages)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients by their global norm over every stage: `torch.nn.utils.clip_grad_norm_` on the
        model's parameters (they all live in this process).  Returns the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type))

    def step(self, inputs: Any, targets: Any = None) -> StepResult:
        """One training step: gradients of the mean loss over the batch are *added* to `.grad` (zero them first).
        `targets` go to `loss_fn`; None when the model takes its labels in `inputs` and `loss_fn` is None.

        With an asynchronous schedule, one PipeDream run instead: micro-batch i is minibatch i, the stages'
        optimizers update the weights during it; `loss` is the mean of the minibatches' losses, each taken
        before its own update (`microbatch_losses`)."""
        warn_if_batch_norm(self.model, self.n_microbatches)
        with intra_op_threads(self.threads), self.finite_checks.step(), loss_check.usage_errors():
            return self._step(inputs, targets)

    def _step(self, inputs: Any, targets: Any) -> StepResult:
        input_chunks, target_chunks, weights = cut_batch(inputs, targets, self.n_microbatches, self.asynchronous,
                                                         self.count_tokens)
        check_traced(self.partition, self.model, input_chunks)
        if self.memory_limits is not None and self.activation_budgets is None:
            self.activation_budgets = self._check_memory(input_chunks[0], target_chunks[0])
        if not self.warmed_up:
            self._warm_up(input_chunks[0], target_chunks[0])
        device_of_stage = self.schedule.device_of_stage()
        observer = MemoryObserver(device_of_stage, self.parameters(), self.activation_budgets)
        for worker in self.workers.values():
            worker.start_step(input_chunks, target_chunks, weights, observer)
        clock = ActionClock(self.devices)

        step_begin = time.perf_counter()
        run_actions(self.schedule, self.order, self.workers, InProcessTransport(self.devices, self.schedule, observer),
                    clock, observer)
        wall_seconds = time.perf_counter() - step_begin
        observer.close()

        trace = self._trace(clock, observer)
        last = self.workers[self.n_stages - 1]
        losses = [float(last.losses[i]) for i in range(self.n_microbatches)]
        return StepResult(step_loss(weights, losses, self.asynchronous), losses, wall_seconds,
                          sum(trace.durations().values()), lambda: trace)

    def infer(self, inputs: Any) -> InferenceResult:
        """Forward only, pipelined (inference): the batch cut into the pipeline's m micro-batches, each through
        every stage once under `torch.no_grad()` (E actions, `pl.schedules.forward_only_like` of this pipeline's
        schedule: the same stages on the same devices); nothing kept for a backward, nothing sent back.
        Returns the last stage's outputs merged in order (what `model(inputs)` returns) and the Trace, whose
        `latencies` and `throughput` give each micro-batch's time in the pipeline and micro-batches per second.
        The model's mode is yours to set (`model.eval()` for dropout and BatchNorm)."""
        schedule = forward_only_like(self.schedule)
        chunks = microbatch.split(inputs, self.n_microbatches)
        check_traced(self.partition, self.model, chunks)
        with intra_op_threads(self.threads), torch.no_grad():
            if not self.warmed_up_forward:  # once, untimed: PyTorch's kernels start lazily
                message = None
                for worker in self.workers.values():
                    worker.start_step(chunks[:1], [None], [1.0])
                for s in range(self.n_stages):
                    message = self._warm_up_action(Action(Kind.E, s, 0), message)
                self.warmed_up_forward = True
            observer = MemoryObserver(schedule.device_of_stage(), self.parameters())
            for worker in self.workers.values():
                worker.start_step(chunks, [None] * len(chunks), [1.0] * len(chunks), observer)
            clock, order = ActionClock(self.devices), run_dependencies(schedule, duration=lambda a: 1.0).time_order()
            begin = time.perf_counter()
            run_actions(schedule, order, self.workers, InProcessTransport(self.devices, schedule, observer), clock,
                        observer)
            wall_seconds = time.perf_counter() - begin
            observer.close()
        last = self.workers[self.n_stages - 1]
        output = merged_outputs([last.outputs[i] for i in range(self.n_microbatches)])
        return InferenceResult(output, self._trace(clock, observer, schedule, order), wall_seconds)

    def generate(self, prompts: torch.Tensor, new_tokens: int, lanes: int | None = None) -> GenerationResult:
        """Greedy generation through this pipeline's stages (a `pl.models.tiny_gpt`): `lanes` groups of prompts in
        flight (default: the pipeline's m), each with its own key/value cache on every stage, one token per lane
        per round (`runtime/generation.py`).  Returns the prompts with their new tokens (the single device's
        greedy text) and a replayed Trace; `tokens_per_second`."""
        with intra_op_threads(self.threads):
            return generate(self.partition.stages, self.devices, self.schedule.device_of_stage(), prompts,
                            new_tokens, self.n_microbatches if lanes is None else lanes)

    def _check_memory(self, inputs: Any, targets: Any) -> dict[int, float]:
        """Before the first step: each device's parameters, gradients, optimizer state and the schedule's predicted
        activations (one micro-batch profiled: `Costs.from_profile`) against `memory_limit_bytes`
        (`predict/budget.py`; refused with each part named); returns what each device's activations may take."""
        costs = Costs.from_profile(self.model, self.partition, (inputs, targets), self.loss_fn, repeats=1,
                                   threads=self.threads)
        needs = check_memory_budget(self.partition, self.schedule, self.memory_limits, costs, self.memory_optimizer,
                                    self.checkpoint)
        return {n.device: self.memory_limits[n.device] - n.model_state_bytes for n in needs}

    def _warm_up(self, inputs: Any, targets: Any) -> None:
        """Run one micro-batch forward and backward through every stage, untimed, its gradients discarded.

        PyTorch initialises kernels lazily: the first backward of some ops costs hundreds of
        milliseconds, which would otherwise show up as one giant action in the trace.  The warm-up
        is a step's own per-stage work (`StageWorker.compute`: fused accumulation, recomputation,
        the split backward), without the weight stash, whose updates would change the weights.
        """
        grads = [(p, p.grad) for p in self.parameters()]
        stashes = {s: worker.stash for s, worker in self.workers.items()}
        with stage_ops.buffers_kept(self.model.buffers()):  # BatchNorm's statistics as before: no extra update
            self._run_warm_up(inputs, targets, grads, stashes)
        self.warmed_up = True

    def _run_warm_up(self, inputs: Any, targets: Any, grads: list, stashes: dict) -> None:
        try:
            for worker in self.workers.values():
                worker.stash = None
                worker.start_step([inputs], [targets], [1.0])
            message = None
            for s in range(self.n_stages):
                message = self._warm_up_action(Action(Kind.F, s, 0), message)
            for s in reversed(range(self.n_stages)):
                if self.workers[s].splits_backward:
                    gradient = self._warm_up_action(Action(Kind.I, s, 0), message)
                    self._warm_up_action(Action(Kind.W, s, 0), None)
                else:
                    gradient = self._warm_up_action(Action(Kind.B, s, 0), message)
                message = gradient
        finally:
            for s, worker in self.workers.items():
                worker.stash = stashes[s]
            for p, grad in grads:
                p.grad = grad

    def _warm_up_action(self, action: Action, message: Any) -> Any:
        worker = self.workers[action.stage]
        if isinstance(message, torch.Tensor):
            message = message.to(worker.device)
        with worker.saved:
            return worker.compute(action, message)

    def _trace(self, clock: ActionClock, observer: MemoryObserver, schedule: Schedule | None = None,
               order: list[Action] | None = None) -> Trace:
        """The step's Trace (the training schedule's, or `schedule` run in `order`: inference)."""
        schedule = self.schedule if schedule is None else schedule
        order = self.order if order is None else order
        intervals = clock.intervals()
        if self.wall_clock:
            origin = min(start for start, _ in intervals.values())
            start = {a: begin - origin for a, (begin, _) in intervals.items()}
            end = {a: finish - origin for a, (_, finish) in intervals.items()}
            source = "measured"
        else:
            # the memory observer's own host time inside each action: not the step's; on CUDA the events
            # time the GPU, which the host runs ahead of, so that time is not in their intervals
            own = observer.own if all(d.type == "cpu" for d in self.devices) else {}
            timing = run_dependencies(schedule,
                                      duration=lambda a: intervals[a][1] - intervals[a][0] - own.get(a, 0.0))
            start, end, source = timing.start, timing.end, "replayed"
        device_of_stage = schedule.device_of_stage()
        events = [Event(a.kind, a.stage, a.microbatch, start[a], end[a], device_of_stage[a.stage]) for a in order]
        workers = self.workers
        memory = activation_samples(events, lambda s, i: workers[s].saved_bytes[i],
                                    lambda s, i: workers[s].recomputed_bytes.get(i, 0), schedule.n_devices,
                                    lambda s, i: workers[s].for_w_bytes[i])
        placed = observer.place(start, end)
        memory += observed_samples(placed, schedule.n_devices)
        for event in events:
            if event.action in clock.allocated:
                memory.append(MemorySample(event.device, event.end, clock.allocated[event.action], "allocated"))
            if event.action in clock.allocated_peak:
                memory.append(MemorySample(event.device, event.start, clock.allocated_peak[event.action],
                                           "allocated_peak"))
        return Trace(events, memory, source, self.n_stages, self.n_microbatches, schedule.n_devices,
                     schedule.name, [str(d) for d in self.devices],
                     observed_peak_parts=observed_breakdown(placed, schedule.n_devices))
