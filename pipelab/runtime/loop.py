"""The loop every engine runs, and the work of one stage inside it.

For each action in a device's list, in order:

    message = transport.receive(action)    # F: the activation from stage s-1; B, I: the gradient from s+1
    clock.begin(action); out = worker.compute(action, message); clock.end(action)
    transport.send(action, out)            # F: to stage s+1; B, I: to stage s-1 (nothing at the ends)

The local and distributed engines both call `run_actions`; they differ only in the transport
(`InProcessTransport`, below, or `runtime/p2p.py`).  `StageWorker` runs an action by its kind
with `model/stage.py`'s per-stage work, tells the `MemoryObserver` of every storage it keeps,
and keeps an asynchronous schedule's weight versions (`runtime/weight_stash.py`).

Details (split backward, weight stashing, the observer): docs/engines.md, "The loop both engines run".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn
from torch.func import functional_call

from ..common.errors import PipelineError, failure
from ..model import boundary
from ..model import stage as stage_ops
from ..model.fused_accumulation import FusedAccumulation
from ..model.kv_cache import cached_forward
from ..schedules.action import Action, Kind
from ..schedules.routes import Routes
from ..schedules.schedule import Schedule
from . import comm_count
from . import failure_hints as hints
from .launcher import progress
from .memory_observer import MemoryObserver
from .weight_stash import WeightStash


@dataclass(frozen=True)
class StagePolicy:
    """How one stage computes: its loss (the last stage's), whether it recomputes its forward (`checkpoint`),
    splits its backward into I and W, keeps weight versions (`stash`, PipeDream), fuses weight-gradient
    accumulation into its Linear multiplies."""

    loss_fn: Callable
    checkpoint: bool = False
    splits_backward: bool = False
    stash: WeightStash | None = None
    fused_accumulation: bool = True


class StageWorker:
    """One stage's modules and what it keeps during a step; `compute` runs one action, by its kind.

    The backward policy is fixed here, once: whole backwards (B), split ones (I then W,
    `splits_backward`), or an asynchronous schedule's weight stash (`stash`, PipeDream).
    Fused weight-gradient accumulation runs only with whole backwards and no stash: a split
    B must leave the weight gradients to W, and a stash moves its own gradients.
    """

    def __init__(self, index: int, module: nn.Module, bounds: tuple[int, int], n_stages: int, device: torch.device,
                 policy: StagePolicy, rank: int | None = None):
        self.index, self.module, self.bounds, self.n_stages = index, module, bounds, n_stages
        self.loss_fn, self.checkpoint, self.device, self.rank = policy.loss_fn, policy.checkpoint, device, rank
        self.splits_backward, self.stash = policy.splits_backward, policy.stash
        fuse = policy.fused_accumulation and not policy.splits_backward and policy.stash is None
        self.fusion = FusedAccumulation(module, list(module.parameters())) if fuse else None
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.copy_input = stage_ops.starts_in_place(module)  # a ReLU(inplace=True) first: compute from a copy
        self.buffers = list(module.buffers())  # BatchNorm's statistics: a recomputation leaves them alone
        self.use_parameters(list(module.parameters()))
        self.run = {Kind.F: self._forward, Kind.B: self._backward, Kind.I: self._input_gradient,
                    Kind.W: self._weight_gradient, Kind.E: self._forward_only, Kind.G: self._generate}

    def use_parameters(self, parameters: list[torch.Tensor]) -> None:
        """The tensors this stage's weights live in (a tensor-parallel rank's shards): what the split backward
        differentiates, and what the saved bytes leave out."""
        self.parameters = parameters
        self.saved = stage_ops.SavedTensors(parameters)  # the loop enters it around each action (`run_actions`)

    def start_step(self, input_chunks: list, target_chunks: list, weights: list[float],
                   observer: MemoryObserver | None = None, evaluating: bool = False) -> None:
        """Take this step's micro-batches (used by the first stage) and targets (by the last); `evaluating`: a
        forward-only pass whose last stage takes the loss (`Engine.evaluate`)."""
        self.inputs, self.targets, self.weights, self.evaluating = input_chunks, target_chunks, weights, evaluating
        self.keep = None if observer is None else partial(observer.keep, self.index)
        self.saved.observe = self.keep  # told of every storage autograd saves
        self.held: dict[int, stage_ops.Held | stage_ops.HeldForW] = {}  # mb -> what it holds until released
        self.saved_bytes: dict[int, int] = {}  # mb -> bytes held from F to its release ("counted")
        self.recomputed_bytes: dict[int, int] = {}  # mb -> bytes held during its backward only (checkpointed)
        self.saved_for_i: dict[int, tuple] = {}  # mb -> what its F saved (`SavedTensors.take`), split backward
        self.for_w_bytes: dict[int, int] = {}  # mb -> bytes held from its I to its W ("counted")
        self.losses: dict[int, torch.Tensor] = {}  # mb -> unweighted loss (last stage)
        self.outputs: dict[int, Any] = {}  # mb -> the model's output, of a forward-only step (last stage)
        self.caches: dict[int, dict] = {}  # generation: lane -> this stage's keys and values

    def compute(self, action: Action, message: Any) -> torch.Tensor | None:
        """Run `action` on `message` (None where there is nothing to receive); return what to send on.
        Called inside `self.saved` (the loop enters it), which counts what autograd saves meanwhile."""
        try:
            return self.run[action.kind](action.microbatch, message)
        except PipelineError:
            raise
        except Exception as error:
            forward = action.kind in (Kind.F, Kind.E)
            arrived = (self.inputs[action.microbatch] if self.is_first else message) if forward else None
            raise failure(error, self.explain(action, arrived, error)) from error

    def _note(self, value: Any, why: str) -> None:
        if self.keep is not None:
            for tensor in boundary.tensors(value):
                self.keep(tensor, why)

    def _stage_function(self, i: int) -> Callable[[Any], torch.Tensor]:
        """What F(i) computes from the stage's input: its blocks (with the version a stash gives micro-batch
        i), and on the last stage the loss of micro-batch i times its weight n_i / N."""
        module = self.module
        if self.stash is not None:  # the live version of the moment, stashed for this micro-batch's B
            weights = self.stash.for_forward(i)
            self.saved.exclude(*weights.values())
            module = partial(functional_call, self.module, weights)
        loss = None
        if self.is_last:
            target = to_device(self.targets[i], self.device)
            loss = partial(_loss_of, self.loss_fn, target=target)
        compute = stage_ops.stage_function(module, self.fusion, loss, self.copy_input)

        def run(inp: Any) -> torch.Tensor:
            output, loss = compute(inp)
            if loss is not None:  # the loss is taken here, weighted by the micro-batch's share n_i / N
                self.losses[i] = loss.detach()
                output = loss * self.weights[i]
            self._note(output, "output")  # until sent (the first run), or until the backward (a recomputation)
            return output

        return run

    def _forward(self, i: int, message: Any) -> torch.Tensor | None:
        inp = stage_ops.as_input(to_device(self.inputs[i], self.device) if self.is_first else message, self.is_first)
        self._note(inp, "input")
        output, self.held[i] = stage_ops.forward(self._stage_function(i), inp, self.checkpoint, self.buffers)
        if self.checkpoint:  # what it holds until its backward: the input's storages
            self.saved_bytes[i] = sum(t.untyped_storage().nbytes() for t in boundary.tensors(inp))
        else:
            self.saved_bytes[i] = self.saved.bytes
        if self.splits_backward:
            self.saved_for_i[i] = self.saved.take()
        return None if self.is_last else boundary.detached(output)

    def _forward_only(self, i: int, message: Any) -> Any:
        """E: the stage's output without a graph (nothing kept, nothing to send back); the last stage keeps the
        micro-batch's output (`outputs`)."""
        inp = to_device(self.inputs[i], self.device) if self.is_first else message
        self._note(inp, "input")
        with torch.no_grad():
            output = self.module(inp)
        self.saved_bytes[i] = 0
        if self.is_last:
            self.outputs[i] = output
            if self.evaluating:  # the micro-batch's loss, unweighted (the driver weighs it)
                self.losses[i] = self.loss_fn(output, to_device(self.targets[i], self.device)).detach()
            return None
        self._note(output, "output")
        return output

    def _generate(self, k: int, message: Any) -> torch.Tensor:
        """G: lane j = k mod lanes, round r = k // lanes (the step's micro-batches are the lanes' prompts).  The
        stage's blocks on the lane's newest tokens (round 0: its prompt) with its own key/value cache
        (`model/kv_cache.py`); the last stage picks the next token (greedy), kept in `outputs` and sent round to
        stage 0 for the lane's next round."""
        lanes = len(self.inputs)
        lane, round_ = k % lanes, k // lanes
        prompt = self.inputs[lane]
        x = to_device(prompt, self.device) if self.is_first and round_ == 0 else message
        start = 0 if round_ == 0 else prompt.shape[1] + round_ - 1
        x = cached_forward(self.module, x, self.caches.setdefault(lane, {}), start)
        if self.is_last:
            x = x[:, -1:].argmax(dim=-1)  # greedy: the next token, (lane's rows, 1)
            self.outputs[k] = x
        return x

    def _recomputing(self, i: int) -> stage_ops.Held:
        """Micro-batch i's `Held`, its input left out of the backward's count (already held since F)."""
        held = self.held[i]
        self.saved.exclude(*boundary.tensors(held.input))
        if self.stash is not None:  # a recomputation runs on the stashed weights: weights, not activations
            self.saved.exclude(*self.stash.weights_of(i).values())
        return held

    def _backward(self, i: int, message: Any) -> torch.Tensor | None:
        """B: the whole backward; the stage is then done with micro-batch i."""
        self._note(message, "received")
        held = self._recomputing(i)
        gradient = self._gradient_to_send(stage_ops.backward(held, message))  # noted while the input is held
        del self.held[i]
        if self.stash is not None:  # the gradients onto the live weights; maybe an update
            self.stash.after_backward(i)
        self.recomputed_bytes[i] = self.saved.bytes
        return gradient

    def _input_gradient(self, i: int, message: Any) -> torch.Tensor | None:
        """I: the input's gradient only; the micro-batch stays for its W."""
        self._note(message, "received")
        held = self._recomputing(i)
        gradient, for_w = stage_ops.input_gradient(held, message, self.parameters)
        gradient = self._gradient_to_send(gradient)  # noted while the input is held
        self.recomputed_bytes[i] = self.saved.bytes
        recorded = for_w.work.recorded_gradients()
        for g in recorded:
            self._note(g, "gradient")  # held until W
        kept, sizes = self.saved_for_i.pop(i, ([], {}))
        recomputed, recomputed_sizes = self.saved.take()  # a checkpointed stage's second forward
        self.for_w_bytes[i] = stage_ops.held_for_w_bytes(for_w, kept + recomputed, {**sizes, **recomputed_sizes})
        self.held[i] = for_w  # from here on, only what W needs
        return gradient

    def _weight_gradient(self, i: int, message: Any) -> None:
        """W: the weight gradients I left; the stage is then done with micro-batch i."""
        stage_ops.weight_gradient(self.held.pop(i))
        return None

    def _gradient_to_send(self, gradient: torch.Tensor | None) -> torch.Tensor | None:
        if self.is_first:
            return None
        self._note(gradient, "gradient")
        return gradient

    def explain(self, action: Action, arrived: Any, error: Exception) -> str:
        """Where it failed (stage, blocks, action, rank) and the original message, plus a hint when the
        input `arrived` at a forward does not fit the stage's first block, or a block hands the next one a tuple
        (`failure_hints.py`)."""
        first, last = self.bounds
        span = (f"modules {self.module.first_module} .. {self.module.last_module}"  # a split by names
                if hasattr(self.module, "first_module") else f"blocks {first}..{last - 1}")
        where = f"{action.describe()} failed on stage {self.index} ({span}"
        where += f", rank {self.rank})" if self.rank is not None else ")"
        text = f"{where}: {type(error).__name__}: {error}"
        if action.kind in (Kind.F, Kind.E):
            origin = None if self.is_first else self.index - 1
            hint = (hints.output_hint(arrived, self.index)
                    or hints.shape_hint(self.module, first, arrived, origin, self.index)
                    or (isinstance(error, TypeError)
                        and hints.non_tensor_hint(self.module, first, to_device(arrived, self.device), origin)))
            if hint:
                text += f"\n  {hint}"
        return text


def _loss_of(loss_fn: Callable, output: torch.Tensor, target: Any) -> torch.Tensor:
    return loss_fn(output, target)


class InProcessTransport:
    """Messages between stages of one process: a copy for the receiving stage, as a real send makes.

    `devices[s]` is stage s's torch device; the schedule says which of its devices runs each stage.
    Between two schedule devices the message is always a copy (`.to` another torch device,
    else `.clone()`), so no storage is shared by two devices' stages (each one's memory is
    its own, and observed as such); between stages of one schedule device it is passed on.
    With an `observer`, the copy counts on the receiver from the moment it is sent.
    """

    def __init__(self, devices: list[torch.device], schedule: Schedule, observer: MemoryObserver | None = None):
        self.devices, self.routes = devices, Routes(schedule)
        self.device_of_stage = schedule.device_of_stage()
        self.observer = observer
        self.box: dict[Action, Any] = {}  # producing action -> its result, on the consumer's device

    def receive(self, action: Action) -> Any:
        source = self.routes.producer(action)
        return None if source is None else self.box.pop(source)

    def send(self, action: Action, message: Any) -> None:
        target = self.routes.consumer_stage(action)
        if target is None:
            return
        other_device = self.device_of_stage[target] != self.device_of_stage[action.stage]
        message = boundary.moved(message, self.devices[target], copy=other_device)
        self.box[action] = message
        if self.observer is not None:
            for tensor in boundary.tensors(message):
                self.observer.keep(target, tensor, "received")


class Transport(Protocol):
    """What the loop needs of whatever carries activations and gradients between stages (`InProcessTransport`,
    `p2p.PointToPointTransport`, `hybrid.ScatterGatherTransport`)."""

    def receive(self, action: Action) -> Any:
        """What `action` needs from another stage (waiting for it if it has not arrived), or None."""

    def send(self, action: Action, tensor: Any) -> None:
        """Hand on what `action` produced to the stage that needs it (nothing for a result nobody needs)."""


def run_actions(schedule: Schedule, actions: Iterable[Action], workers: dict[int, StageWorker], transport: Transport,
                clock, observer: MemoryObserver | None = None, reporting: bool = True) -> None:
    """Run `actions` (of `schedule`) in order: receive, compute (timed by `clock`; its host window noted by
    `observer`), send.  A stage's failure ends with its device's list, the failing action marked.
    In a rank of `pl.distributed.launch`, each action is reported to the launcher (`runtime/launcher/progress.py`), a
    step's (not a warm-up's, `reporting=False`)."""
    report = progress.reporter() if reporting else None
    for action in actions:
        with comm_count.during(action):
            _run_action(schedule, action, workers[action.stage], transport, clock, observer, report)
    if report is not None:
        report.step_done()


def _run_action(schedule: Schedule, action: Action, worker: StageWorker, transport: Transport, clock,
                observer: MemoryObserver | None, report) -> None:
    """Receive, compute, send: one action of `run_actions`."""
    if report is not None:
        report.waiting(schedule, action)
    message = transport.receive(action)
    if report is not None:
        report.computing(action)
    clock.begin(action, worker.device)
    if observer is not None:  # its window inside the clock's: on a CPU no change falls outside the action
        observer.begin(action)
    try:
        with worker.saved:  # a saved_tensors_hooks context: counts, and tells the observer, what autograd saves
            out = worker.compute(action, message)
    except PipelineError as error:
        error.args = (f"{error}\n{marked_list(schedule, action)}", *error.args[1:])
        raise
    message = None  # a received gradient is used up: free it inside its action
    if observer is not None:
        observer.end(action)
    clock.end(action, worker.device)
    transport.send(action, out)


def marked_list(schedule: Schedule, action: Action, around: int = 6) -> str:
    """The list of the device that runs `action`, with it marked: ``device 1 runs: 1F0 1F1 >>1B0<< 1F2 ...``
    (the `around` actions on either side of it; PyTorch's schedules print such a dump on a failure)."""
    device = schedule.device_of_stage()[action.stage]
    row = schedule.actions[device]
    k = row.index(action)
    cells = [f">>{a}<<" if a == action else str(a) for a in row[max(k - around, 0):k + around + 1]]
    before = "... " if k > around else ""
    after = " ..." if k + around + 1 < len(row) else ""
    return f"device {device} runs: {before}{' '.join(cells)}{after} (action {k + 1} of {len(row)})"


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
