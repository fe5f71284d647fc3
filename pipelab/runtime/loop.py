"""The loop every engine runs, and the work of one stage inside it.

For each action in a device's list, in order:

    message = transport.receive(action)    # F: the activation from stage s-1; B: the gradient from s+1
    clock.begin(action); out = worker.compute(action, message); clock.end(action)
    transport.send(action, out)            # F: to stage s+1; B: to stage s-1 (nothing at the ends)
    # then the loop lets go of both, so neither outlives its use

A `MemoryObserver` (`runtime/memory_observer.py`) is told of every storage a stage keeps
(what autograd saves, the stage's input, its output until sent, the gradients) and of the
host window of every action: the "observed" memory curve of both engines comes from it.

The local engine (`runtime/local.py`) and the distributed engine (`runtime/distributed.py`)
both call `run_actions`; they differ only in the transport: an in-process copy
(`InProcessTransport`, below) or `torch.distributed` point-to-point (`runtime/p2p.py`).
`StageWorker.compute` is the per-stage work of `model/stage.py` (forward, backward,
checkpointing, loss weighting n_i / N, saved-bytes counting), the same in both engines.

When the schedule splits the backward (W actions: zero bubble), a stage's B computes only
its input's gradient (what the previous stage waits for) and keeps the micro-batch; its W
computes the weight gradients and lets the micro-batch go (`stage.backward_input` /
`stage.backward_weight`, exact: no gradient is computed twice).

An asynchronous schedule (`pl.schedules.pipedream_async`) gives each stage a `WeightStash`
(`runtime/weight_stash.py`): F runs with the live weights' version of the moment, stashed;
B differentiates with that version and the stage's own optimizer updates the live weights.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.func import functional_call

from ..common.errors import PipelineError
from ..model import stage as stage_ops
from ..model.fused_accumulation import FusedAccumulation
from ..schedules.action import Action
from .memory_observer import MemoryObserver
from .weight_stash import WeightStash


def producer(action: Action, n_stages: int) -> Action | None:
    """The action on a neighbouring stage whose result `action` needs (DESIGN.md), or None.

    F(s, i) needs the activation of F(s-1, i); B(s, i) the gradient of B(s+1, i).
    """
    s, i = action.stage, action.microbatch
    if action.kind == "F" and s > 0:
        return Action("F", s - 1, i)
    if action.kind == "B" and s < n_stages - 1:
        return Action("B", s + 1, i)
    return None


def consumer_stage(action: Action, n_stages: int) -> int | None:
    """The stage that receives what `action` produces, or None (stage 0's B, the last stage's F)."""
    s = action.stage
    if action.kind == "F" and s < n_stages - 1:
        return s + 1
    if action.kind == "B" and s > 0:
        return s - 1
    return None


class StageWorker:
    """One stage's modules and what it keeps during a step; `compute` does one action's work."""

    def __init__(self, index: int, module: nn.Module, bounds: tuple[int, int], n_stages: int, loss_fn: Callable,
                 checkpoint: bool, device: torch.device, rank: int | None = None, split_backward: bool = False,
                 fused_accumulation: bool = True):
        self.index, self.module, self.bounds, self.n_stages = index, module, bounds, n_stages
        self.loss_fn, self.checkpoint, self.device, self.rank = loss_fn, checkpoint, device, rank
        self.split_backward = split_backward  # the schedule has W actions: B input gradient only, W the weights
        self.parameters = list(module.parameters())
        # weight gradients added into .grad inside the multiply (model/fused_accumulation.py); not with a split
        # backward, whose B must leave them to W, nor with a weight stash (`attach_stashes` removes it)
        self.fusion = (FusedAccumulation(module, self.parameters) if fused_accumulation and not split_backward
                       else None)
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.free_outputs = True  # keep only the output's GradientEdge after F (stage.release_output)
        self.observer: MemoryObserver | None = None
        self.stash: WeightStash | None = None  # an asynchronous schedule's weight versions (PipeDream)

    def start_step(self, input_chunks: list, target_chunks: list, weights: list[float],
                   observer: MemoryObserver | None = None) -> None:
        """Take this step's micro-batches (used by the first stage) and targets (by the last)."""
        self.inputs, self.targets, self.weights = input_chunks, target_chunks, weights
        self.observer = observer
        self.kept: dict[int, stage_ops.InFlight] = {}  # mb -> what it holds from F to B (to W if split)
        self.saved_bytes: dict[int, int] = {}  # mb -> bytes held from F to B (to W if split)
        self.recomputed_bytes: dict[int, int] = {}  # mb -> bytes held during B only (checkpointed)
        self.losses: dict[int, torch.Tensor] = {}  # mb -> unweighted loss (last stage)

    def compute(self, action: Action, message: Any) -> torch.Tensor | None:
        """Run `action` on `message` (None where there is nothing to receive); return what to send on."""
        try:
            return self._compute(action, message)
        except PipelineError:
            raise
        except Exception as error:
            arrived = (self.inputs[action.microbatch] if self.is_first else message) if action.kind == "F" else None
            raise PipelineError(self.explain(action, arrived, error)) from error

    def _compute(self, action: Action, message: Any) -> torch.Tensor | None:
        i, observer = action.microbatch, self.observer
        keep = None if observer is None else partial(observer.keep, self.index)
        if action.kind == "F":
            arrived = to_device(self.inputs[i], self.device) if self.is_first else message
            if keep is not None:
                keep(arrived, "input")
            module, parameters = self.module, self.parameters
            if self.stash is not None:  # the live version of the moment, stashed for this micro-batch's B
                weights = self.stash.for_forward(i)
                module, parameters = partial(functional_call, self.module, weights), list(weights.values())
            flight = stage_ops.forward(
                module, arrived, parameters, is_first=self.is_first,
                loss_fn=self.loss_fn if self.is_last else None,
                target=to_device(self.targets[i], self.device) if self.is_last else None,
                weight=self.weights[i], checkpoint=self.checkpoint, keep=keep,
                fused=self.fusion,
            )
            self.kept[i], self.saved_bytes[i] = flight, flight.saved_bytes
            sent = flight.sent
            if keep is not None:
                keep(flight.output if flight.output is not None else sent, "output")
            if self.free_outputs:
                stage_ops.release_output(flight)
            if self.is_last:
                self.losses[i] = flight.loss.detach()
                return None
            return sent
        if action.kind == "B":
            if keep is not None:
                keep(message, "received")
            if self.split_backward:  # keep the micro-batch for its W
                flight = self.kept[i]
                gradient = stage_ops.backward_input(flight, message, self.parameters)
                if keep is not None:
                    for recorded in flight.weight_work.recorded_gradients():
                        keep(recorded, "gradient")  # held until W
            else:
                flight = self.kept.pop(i)
                gradient = stage_ops.backward(flight, message)
                if self.stash is not None:  # the gradients onto the live weights; maybe an update
                    self.stash.after_backward(i)
            self.recomputed_bytes[i] = flight.recomputed_bytes
            if self.is_first:
                return None
            if keep is not None:
                keep(gradient, "gradient")
            return gradient
        if action.kind == "W" and self.split_backward:
            stage_ops.backward_weight(self.kept.pop(i))
            return None
        if action.kind == "W":
            raise PipelineError(f"{action.describe()}: stage {self.index} runs whole backwards (its schedule "
                                "has no W actions for it), so there is no weight-gradient half left to run")
        raise PipelineError(f"{action.describe()}: this engine runs F, B and W actions, not {action.kind!r}")

    def explain(self, action: Action, arrived: Any, error: Exception) -> str:
        """Where it failed (stage, blocks, action, rank) and the original message, plus a hint when the
        input `arrived` at a forward does not fit the stage's first block."""
        first, last = self.bounds
        where = f"{action.describe()} failed on stage {self.index} (blocks {first}..{last - 1}"
        where += f", rank {self.rank})" if self.rank is not None else ")"
        text = f"{where}: {type(error).__name__}: {error}"
        if action.kind == "F":
            hint = _shape_hint(self.module, first, arrived, None if self.is_first else self.index - 1, self.index)
            if hint:
                text += f"\n  {hint}"
        return text


def _shape_hint(module: nn.Module, first_block: int, arrived: Any, from_stage: int | None, stage: int) -> str:
    """Say what the stage's first block expected, when its first Linear or LayerNorm does not fit the input
    (its feature size, or its dtype)."""
    if not isinstance(arrived, torch.Tensor) or arrived.dim() == 0 or len(module) == 0:
        return ""
    block = module[0]
    layer = next((m for m in block.modules() if isinstance(m, (nn.Linear, nn.LayerNorm))), None)
    if layer is None:
        return ""
    expected = layer.in_features if isinstance(layer, nn.Linear) else layer.normalized_shape[-1]
    origin = "the input batch" if from_stage is None else f"stage {from_stage}'s output"
    got = f"stage {stage} received {origin} of shape {tuple(arrived.shape)} ({arrived.dtype}); "
    if arrived.shape[-1] != expected:
        return got + (f"block {first_block} ({type(block).__name__}) expects {expected} features "
                      "in the last dimension")
    weight = getattr(layer, "weight", None)
    if weight is not None and arrived.dtype != weight.dtype:
        return got + f"block {first_block} ({type(block).__name__}) computes in {weight.dtype}"
    return ""


class InProcessTransport:
    """Messages between stages of one process: a copy for the receiving stage, as a real send makes.

    `devices[s]` is stage s's torch device, `device_of_stage[s]` its device in the schedule.
    Between two schedule devices the message is always a copy (`.to` another torch device,
    else `.clone()`), so no storage is shared by two devices' stages (each one's memory is
    its own, and observed as such); between stages of one schedule device it is passed on.
    With an `observer`, the copy counts on the receiver from the moment it is sent.
    """

    def __init__(self, devices: list[torch.device], device_of_stage: dict[int, int] | None = None,
                 observer: MemoryObserver | None = None):
        self.devices, self.n_stages = devices, len(devices)
        self.device_of_stage = device_of_stage or {s: s for s in range(self.n_stages)}
        self.observer = observer
        self.box: dict[Action, Any] = {}  # producing action -> its result, on the consumer's device

    def receive(self, action: Action) -> Any:
        source = producer(action, self.n_stages)
        return None if source is None else self.box.pop(source)

    def send(self, action: Action, tensor: torch.Tensor | None) -> None:
        target = consumer_stage(action, self.n_stages)
        if target is None:
            return
        device = self.devices[target]
        if tensor.device != device:
            tensor = tensor.to(device)
        elif self.device_of_stage[target] != self.device_of_stage[action.stage]:
            tensor = tensor.clone()
        self.box[action] = tensor
        if self.observer is not None:
            self.observer.keep(target, tensor, "received")


def run_actions(actions: Iterable[Action], workers: dict[int, StageWorker], transport, clock,
                observer: MemoryObserver | None = None) -> None:
    """Run `actions` in order: receive, compute (timed by `clock`; its host window noted by `observer`), send."""
    for action in actions:
        worker = workers[action.stage]
        message = transport.receive(action)
        clock.begin(action, worker.device)
        if observer is not None:  # its window inside the clock's: on a CPU no change falls outside the action
            observer.begin(action, worker.device)
        out = worker.compute(action, message)
        message = None  # a received gradient is used up: free it inside its action
        if observer is not None:
            observer.end(action, worker.device)
        clock.end(action, worker.device)
        transport.send(action, out)
        out = None


def to_device(batch: Any, device: torch.device) -> Any:
    """Copy every tensor of `batch` to `device` (a fresh copy, so a micro-batch owns its own storage)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, copy=True)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        items = [to_device(v, device) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch
