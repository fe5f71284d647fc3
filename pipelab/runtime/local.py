"""The local engine: run any valid Schedule in one process, on GPUs or on the CPU.

`Pipeline.step(x, y)` splits the batch into micro-batches, then performs the schedule's
actions in a dependency-respecting order (`pipelab.timing`).  "Sending" an activation
or a gradient is a copy to the next stage's device.  Each micro-batch's loss is weighted
by its share of the batch, n_i / N, so the summed gradients equal those of the mean loss
over the whole batch:

    mean over N samples = sum_i (n_i / N) * (mean over micro-batch i)

Timing: with one CUDA device per stage the devices really run concurrently and CUDA
events give each action's wall-clock start and end ("measured").  When stages share a
device (all on a CPU, or more stages than GPUs) the actions run one after another, each
timed, and the measured durations are replayed on one virtual clock per stage
("replayed"), the step as it would run with one device per stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .. import microbatch
from ..actions import Action, Schedule
from ..errors import PipelineError
from ..memory import activation_samples, checkpoint_plan
from ..partition import Partition, split
from ..schedules import by_name, validate
from ..timing import run_dependencies
from ..trace import Event, MemorySample, Trace
from . import stage as stage_ops
from .devices import assign_devices


@dataclass
class StepResult:
    loss: float  # mean loss over the whole batch
    trace: Trace
    microbatch_losses: list[float]
    wall_seconds: float  # host time for the whole step, engine overhead included
    op_seconds: float  # sum of the measured durations of all actions


class Pipeline:
    """Pipeline-parallel training of an `nn.Sequential` model on local devices.

    Args:
        model: an `nn.Sequential` of blocks (see `pl.models`); its parameters receive the gradients.
        n_stages, n_microbatches: p and m.
        schedule: "gpipe", "1f1b" or a `Schedule` for the same p and m (validated).
        loss_fn: loss(output, target) returning the *mean* over a micro-batch.
        devices: "auto", "cpu", "cuda", a device name, or a list with one device per stage.
        split_method: "uniform", "params", "time" (needs `sample`) or a ready `Partition`.
        checkpoint: activation checkpointing per stage: "never", "always", "except_last"
            (the last stage runs B right after F in 1F1B, so recomputing there saves little)
            or a list of booleans, one per stage.
    """

    def __init__(self, model: nn.Module, n_stages: int, n_microbatches: int, schedule: str | Schedule = "1f1b",
                 loss_fn: Callable | None = None, devices: Any = "auto", split_method: str | Partition = "uniform",
                 sample: Any = None, checkpoint: str | list[bool] = "never"):
        if loss_fn is None or not callable(loss_fn):
            raise TypeError("Pipeline needs loss_fn=<callable(output, target) -> mean loss of the micro-batch>")
        if getattr(loss_fn, "reduction", "mean") != "mean":
            raise PipelineError(
                f"loss_fn has reduction={loss_fn.reduction!r}; pipelab weights each micro-batch's mean loss by its "
                "size, so the loss must use reduction='mean'"
            )
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
        self.partition = split_method if isinstance(split_method, Partition) else split(model, n_stages, split_method, sample)
        if len(self.partition) != n_stages:
            raise PipelineError(f"the partition has {len(self.partition)} stages, not n_stages={n_stages}")
        self.model, self.loss_fn = model, loss_fn
        self.n_stages, self.n_microbatches = n_stages, n_microbatches
        self.schedule = self._resolve_schedule(schedule)
        self.checkpoint = checkpoint_plan(checkpoint, n_stages)
        self.devices = assign_devices(devices, n_stages)
        for stage, device in zip(self.partition.stages, self.devices):
            stage.to(device)
        self.parameters = [list(stage.parameters()) for stage in self.partition.stages]
        self._warm = False
        self.order = run_dependencies(self.schedule, duration=lambda a: 1.0).time_order()
        device_of_stage = self.schedule.device_of_stage()
        self.wall_clock = (
            all(d.type == "cuda" for d in self.devices) and len(set(self.devices)) == n_stages
            and sorted(device_of_stage.values()) == list(range(n_stages))
        )

    def _resolve_schedule(self, schedule) -> Schedule:
        if isinstance(schedule, str):
            schedule = by_name(schedule, self.n_stages, self.n_microbatches)
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a name or a pipelab Schedule, got {type(schedule).__name__}")
        if (schedule.n_stages, schedule.n_microbatches) != (self.n_stages, self.n_microbatches):
            raise PipelineError(
                f"the schedule is for {schedule.n_stages} stages x {schedule.n_microbatches} micro-batches, "
                f"but the pipeline has {self.n_stages} x {self.n_microbatches}"
            )
        validate(schedule)
        if any(a.kind == "W" for a in schedule.all_actions()):
            raise PipelineError("this schedule splits the backward into B and W; the local engine runs whole backwards only")
        return schedule

    def step(self, inputs: Any, targets: Any) -> StepResult:
        """One training step: gradients of the mean loss over the batch are *added* to `.grad` (zero them first)."""
        total = microbatch.batch_size(inputs)
        if microbatch.batch_size(targets) != total:
            raise ValueError(f"inputs hold {total} samples but targets hold {microbatch.batch_size(targets)}")
        input_chunks = microbatch.split(inputs, self.n_microbatches)
        target_chunks = microbatch.split(targets, self.n_microbatches)
        if not self._warm:
            self._warm_up(input_chunks[0], target_chunks[0])
        weights = [size / total for size in microbatch.sizes(total, self.n_microbatches)]
        last = self.n_stages - 1
        received: dict[tuple[int, int], Any] = {}  # (stage, mb) -> activation that arrived
        gradients: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> gradient that arrived
        kept: dict[tuple[int, int], stage_ops.InFlight] = {}
        saved_bytes: dict[tuple[int, int], int] = {}  # held from F to B
        recomputed_bytes: dict[tuple[int, int], int] = {}  # held during B only (checkpointed stages)
        losses = [0.0] * self.n_microbatches
        clock = _Clock(self.devices)
        allocated: dict[Action, int] = {}

        step_begin = time.perf_counter()
        for action in self.order:
            s, i, device = action.stage, action.microbatch, self.devices[action.stage]
            clock.begin(action, device)
            if action.kind == "F":
                arrived = _to(input_chunks[i], device) if s == 0 else received.pop((s, i))
                flight = stage_ops.forward(
                    self.partition.stages[s], arrived, self.parameters[s], is_first=(s == 0),
                    loss_fn=self.loss_fn if s == last else None,
                    target=_to(target_chunks[i], device) if s == last else None, weight=weights[i],
                    checkpoint=self.checkpoint[s],
                )
                kept[(s, i)], saved_bytes[(s, i)] = flight, flight.saved_bytes
                if s < last:
                    received[(s + 1, i)] = flight.sent.to(self.devices[s + 1])
                else:
                    losses[i] = flight.loss.detach()
            else:
                flight = kept.pop((s, i))
                gradient = stage_ops.backward(flight, gradients.pop((s, i), None))
                recomputed_bytes[(s, i)] = flight.recomputed_bytes
                if s > 0:
                    gradients[(s - 1, i)] = gradient.to(self.devices[s - 1])
            clock.end(action, device)
            if device.type == "cuda":
                allocated[action] = torch.cuda.memory_allocated(device)
        wall_seconds = time.perf_counter() - step_begin

        trace = self._trace(clock, saved_bytes, recomputed_bytes, allocated)
        losses = [float(loss) for loss in losses]
        loss = sum(w * l for w, l in zip(weights, losses))
        return StepResult(loss, trace, losses, wall_seconds, sum(trace.durations().values()))

    def _warm_up(self, inputs: Any, targets: Any) -> None:
        """Run one micro-batch forward and backward once, untimed, leaving `.grad` untouched.

        PyTorch initialises kernels lazily: the first backward of some ops costs hundreds
        of milliseconds, which would otherwise show up as one giant action in the trace.
        """
        x = _to(inputs, self.devices[0])
        last = self.n_stages - 1
        for s, (stage, device) in enumerate(zip(self.partition.stages, self.devices)):
            inp = x.to(device) if isinstance(x, torch.Tensor) else x
            if s > 0 and isinstance(inp, torch.Tensor) and inp.is_floating_point():
                inp = inp.detach().requires_grad_(True)
            out = stage(inp)
            stage_ops.check_activation(out)
            if s == last:
                out = self.loss_fn(out, _to(targets, device))
            wrt = [t for t in [inp, *self.parameters[s]] if isinstance(t, torch.Tensor) and t.requires_grad]
            if wrt:
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            x = out.detach()
        self._warm = True

    def _trace(self, clock: "_Clock", saved_bytes: dict, recomputed_bytes: dict, allocated: dict) -> Trace:
        durations = clock.durations()
        if self.wall_clock:
            start, source = clock.wall_starts(), "measured"
            end = {a: start[a] + durations[a] for a in start}
        else:
            timing = run_dependencies(self.schedule, duration=durations.__getitem__)
            start, end, source = timing.start, timing.end, "replayed"
        device_of_stage = self.schedule.device_of_stage()
        events = [Event(a.stage, a.kind, a.microbatch, start[a], end[a], device_of_stage[a.stage]) for a in self.order]
        memory = activation_samples(events, lambda s, i: saved_bytes[(s, i)],
                                    lambda s, i: recomputed_bytes.get((s, i), 0), self.schedule.n_devices)
        for event in events:
            if event.action in allocated:
                memory.append(MemorySample(event.device, event.end, allocated[event.action], "allocated"))
        return Trace(events, memory, source, self.n_stages, self.n_microbatches, self.schedule.n_devices,
                     self.schedule.name, [str(d) for d in self.devices])


class _Clock:
    """Times each action: perf_counter on the CPU, CUDA events on a GPU (read after the step)."""

    def __init__(self, devices: list[torch.device]):
        self.seconds: dict[Action, float] = {}
        self.began: dict[Action, float] = {}
        self.events: dict[Action, tuple] = {}
        self.origin = {}
        for device in set(devices):
            if device.type == "cuda":
                self.origin[device] = torch.cuda.Event(enable_timing=True)
                self.origin[device].record(torch.cuda.current_stream(device))

    def begin(self, action: Action, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self.events[action] = (device, event)
        else:
            self.began[action] = time.perf_counter()

    def end(self, action: Action, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self.events[action] += (event,)
        else:
            self.seconds[action] = time.perf_counter() - self.began.pop(action)

    def durations(self) -> dict[Action, float]:
        if self.events:
            torch.cuda.synchronize()
        found = dict(self.seconds)
        for action, (_, begin, end) in self.events.items():
            found[action] = begin.elapsed_time(end) / 1e3
        return found

    def wall_starts(self) -> dict[Action, float]:
        """Start of each action in seconds after its device's step origin (CUDA only)."""
        return {a: self.origin[d].elapsed_time(begin) / 1e3 for a, (d, begin, _) in self.events.items()}


def _to(batch: Any, device: torch.device) -> Any:
    """Copy every tensor of `batch` to `device` (a fresh copy, so a micro-batch owns its own storage)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, copy=True)
    if isinstance(batch, dict):
        return type(batch)((k, _to(v, device)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        items = [_to(v, device) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch
