"""One stage's work on one micro-batch: forward (keeping the graph) and backward.

A stage receives an activation, detaches it from the previous stage's graph and makes it
a leaf that requires grad, so that its backward stops at the stage boundary and leaves
the gradient to send back in `input.grad`.  Backward accumulates into the parameters'
`.grad` (like any `loss.backward()`), which is how the gradients of the micro-batches
add up to the gradient of the whole batch.

Activation memory is measured as autograd keeps it: every tensor saved for backward
during the forward passes through `torch.autograd.graph.saved_tensors_hooks`; the bytes
of their storages are summed once per storage, leaving out the stage's own parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class InFlight:
    """What a stage keeps for one micro-batch between its forward and its backward."""

    input: Any
    output: torch.Tensor  # the stage output, or the weighted loss on the last stage
    saved_bytes: int
    loss: torch.Tensor | None = None  # unweighted micro-batch loss (last stage)


class SavedBytesCounter:
    """Counts the bytes autograd saves for backward, once per storage, parameters excluded."""

    def __init__(self, parameters: list[torch.Tensor]):
        self.excluded = {_storage_key(p) for p in parameters}
        self.seen: set = set()
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self.excluded and key not in self.seen:
            self.seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


def forward(stage: nn.Module, received: Any, parameters: list[torch.Tensor], is_first: bool,
            loss_fn: Callable | None = None, target: Any = None, weight: float = 1.0) -> InFlight:
    """Run `stage` on `received`; on the last stage (loss_fn given) also the loss, times `weight`."""
    if is_first or not isinstance(received, torch.Tensor) or not received.is_floating_point():
        inp = received
    else:
        inp = received.detach().requires_grad_(True)
    counter = SavedBytesCounter(parameters)
    with counter.hooks():
        output = stage(inp)
        loss = None
        if loss_fn is not None:
            loss = loss_fn(output, target)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError("loss_fn must return a scalar tensor (the mean loss of the micro-batch)")
            output = loss * weight
    if loss_fn is None:
        check_activation(output)
    return InFlight(inp, output, counter.bytes, loss)


def check_activation(output: Any) -> None:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a stage returned {type(output).__name__}; pipelab passes one tensor between stages")


def backward(kept: InFlight, grad_output: torch.Tensor | None) -> torch.Tensor | None:
    """Backpropagate through the stage (accumulating parameter grads); return the input's gradient."""
    if grad_output is None:
        kept.output.backward()
    else:
        kept.output.backward(grad_output)
    inp = kept.input
    if isinstance(inp, torch.Tensor) and inp.requires_grad:
        return inp.grad
    return None
