"""One stage's work on one micro-batch: forward (keeping the graph) and backward.

A stage receives an activation, detaches it from the previous stage's graph and makes it
a leaf that requires grad, so that its backward stops at the stage boundary and leaves
the gradient to send back in `input.grad`.  Backward accumulates into the parameters'
`.grad` (like any `loss.backward()`), which is how the gradients of the micro-batches
add up to the gradient of the whole batch.

Activation memory is counted as autograd keeps it: every tensor saved for backward
during the forward passes through `torch.autograd.graph.saved_tensors_hooks`; the bytes
of their storages are summed once per storage, leaving out the stage's own parameters
(`saved_bytes`, the "counted" figure).  The hook also hands each saved tensor to `keep`
(the engine's `MemoryObserver`, which measures when the storage is really freed).

Between F and B a stage needs its output only as a place in the graph to start the
backward from, not its values (whatever backward needs of them autograd saved).  After the
output is sent, `release_output` keeps its `GradientEdge` and drops the tensor, so its
storage is freed (Megatron-LM's `deallocate_output_tensor` does this by shrinking
`output.data`; a `GradientEdge` does it with public API and no aliasing risk).  The
backward then starts from the edge: the same graph, the same gradients.

A split backward (zero-bubble schedules, `pipelab.model.split_backward`): `backward_input` (I)
computes only the input's gradient and keeps the graph with what W needs; `backward_weight`
(W) then adds the weight gradients.  A micro-batch is held from its F to its W.

Activation checkpointing (Chen et al. 2016, "Training deep nets with sublinear memory
cost"): the forward runs without building a graph and keeps only the stage's input; the
backward first runs the forward again (with the random state of the first run), then
backpropagates.  Memory between F and B drops to the input; B costs one more forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import split_backward
from .fused_accumulation import FusedAccumulation


@dataclass
class InFlight:
    """What a stage keeps for one micro-batch between its forward and its backward."""

    input: Any
    output: torch.Tensor | None  # the stage output (or weighted loss on the last stage); None if checkpointed
    saved_bytes: int  # bytes held from F to B: saved activations, or only the input when checkpointed
    loss: torch.Tensor | None = None  # unweighted micro-batch loss (last stage)
    recompute: Callable[[], tuple[torch.Tensor, int]] | None = None  # checkpointed: redo the forward
    recomputed_bytes: int = 0  # bytes the recomputation saved during the backward
    sent: torch.Tensor | None = None  # the activation for the next stage (no graph attached)
    edge: Any = None  # the output's GradientEdge once `release_output` dropped the output
    weight_work: split_backward.WeightWork | None = None  # a split backward: what B leaves for W


class SavedBytesCounter:
    """Counts the bytes autograd saves for backward, once per storage, parameters excluded."""

    def __init__(self, parameters: list[torch.Tensor], keep: Callable[[torch.Tensor], None] | None = None):
        self.excluded = {_storage_key(p) for p in parameters}
        self.seen: set = set()
        self.bytes = 0
        self.keep = keep  # told of every storage counted

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for plain in _plain_tensors(tensor):
            key = _storage_key(plain)
            if key not in self.excluded and key not in self.seen:
                self.seen.add(key)
                self.bytes += plain.untyped_storage().nbytes()
                if self.keep is not None:
                    self.keep(plain)
        # detached: the saved object must not hold the tensor itself, else a node that saves its own output
        # (softmax, exp) and that output hold each other, and a graph kept past its backward (retain_graph,
        # a split backward's B) is never freed (torch.autograd.graph.saved_tensors_hooks, warning)
        return tensor.detach()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `tensor`'s memory: a wrapper subclass (a DTensor under tensor
    parallelism) has no storage of its own, only the tensors it wraps."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        return [t for value in inner if isinstance(value, torch.Tensor) for t in _plain_tensors(value)]
    return [tensor]


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


def forward(stage: nn.Module, received: Any, parameters: list[torch.Tensor], is_first: bool,
            loss_fn: Callable | None = None, target: Any = None, weight: float = 1.0,
            checkpoint: bool = False, keep: Callable[[torch.Tensor], None] | None = None,
            fused: FusedAccumulation | None = None) -> InFlight:
    """Run `stage` on `received`; on the last stage (loss_fn given) also the loss, times `weight`.

    `fused` (the stage's `FusedAccumulation`): its Linear layers add their weight gradients into
    `.grad` inside the multiply (`model/fused_accumulation.py`), in the forward and in a
    recomputation alike.

    `keep(tensor)` is called on each tensor autograd saves (parameters left out), in the
    forward and in a checkpointed stage's recomputation; `keep(output, "output")` on the
    recomputed output.
    """
    if is_first or not isinstance(received, torch.Tensor) or not received.is_floating_point():
        inp = received
    else:
        inp = received.detach().requires_grad_(True)

    def run(exclude: set = frozenset()) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        counter = SavedBytesCounter(parameters, keep)
        counter.excluded |= exclude
        with counter.hooks(), (fused if fused is not None else contextlib.nullcontext()):
            output = stage(inp)
            loss = None
            if loss_fn is not None:
                loss = loss_fn(output, target)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise TypeError("loss_fn must return a scalar tensor (the mean loss of the micro-batch)")
                output = loss * weight
        if loss_fn is None:
            check_activation(output)
        return output, loss, counter.bytes

    if not checkpoint:
        output, loss, saved = run()
        return InFlight(inp, output, saved, loss, sent=None if loss_fn else output.detach())
    rng = _rng_state(inp)
    with torch.no_grad():
        output, loss, _ = run()
    kept = {_storage_key(inp)} if isinstance(inp, torch.Tensor) else set()
    kept_bytes = inp.untyped_storage().nbytes() if isinstance(inp, torch.Tensor) else 0

    def recompute() -> tuple[torch.Tensor, int]:
        with torch.random.fork_rng(devices=rng[1]):
            _set_rng_state(rng)
            again, _, saved_again = run(exclude=kept)
        if keep is not None:
            keep(again, "output")
        return again, saved_again

    return InFlight(inp, None, kept_bytes, loss, recompute, sent=None if loss_fn else output)


def _rng_state(inp: Any) -> tuple:
    devices = [inp.device.index] if isinstance(inp, torch.Tensor) and inp.is_cuda else []
    cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
    return torch.get_rng_state(), devices, cuda_states


def _set_rng_state(state: tuple) -> None:
    cpu_state, devices, cuda_states = state
    torch.set_rng_state(cpu_state)
    for device, cuda_state in zip(devices, cuda_states):
        torch.cuda.set_rng_state(cuda_state, device)


def check_activation(output: Any) -> None:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a stage returned {type(output).__name__}; pipelab passes one tensor between stages")


def release_output(kept: InFlight) -> None:
    """Drop the output (and the activation sent on), keeping only the output's GradientEdge.

    Exact: the backward from the edge runs the same graph with the same incoming gradient.
    An output that does not require grad is left in place (its backward fails as before).
    """
    if kept.output is not None and kept.output.requires_grad:
        kept.edge = torch.autograd.graph.get_gradient_edge(kept.output)
        kept.output = None
    kept.sent = None


def backward(kept: InFlight, grad_output: torch.Tensor | None) -> torch.Tensor | None:
    """Backpropagate through the stage (accumulating parameter grads); return the input's gradient."""
    if kept.recompute is not None:
        kept.output, kept.recomputed_bytes = kept.recompute()
    if kept.output is None and kept.edge is not None:
        torch.autograd.backward(kept.edge, grad_output)
    elif grad_output is None:
        kept.output.backward()
    else:
        kept.output.backward(grad_output)
    inp = kept.input
    if isinstance(inp, torch.Tensor) and inp.requires_grad:
        return inp.grad
    return None


def backward_input(kept: InFlight, grad_output: torch.Tensor | None, parameters: list[torch.Tensor]) -> torch.Tensor | None:
    """B of a split backward: return the input's gradient (None on a stage whose input needs none) and keep
    in `kept.weight_work` what W needs (the graph stays; the output's values are dropped).  A checkpointed
    stage recomputes its forward first, as `backward` does."""
    if kept.recompute is not None:
        kept.output, kept.recomputed_bytes = kept.recompute()
        kept.recompute = None
    root = kept.output if kept.output is not None else kept.edge
    grad_input, kept.weight_work = split_backward.backward_input(root, grad_output, kept.input, parameters)
    kept.output = kept.edge = None  # the work holds the graph from the output's edge
    return grad_input


def backward_weight(kept: InFlight) -> None:
    """W of a split backward: add the weight gradients B left to compute into the parameters' `.grad`."""
    if kept.weight_work is None:
        raise RuntimeError("W before its B: no input-gradient half has run for this micro-batch")
    split_backward.backward_weight(kept.weight_work)
    kept.weight_work = None
