"""Mutant of Task 1.3: a received tensor that is already a leaf is used as the input leaf.

"It is a leaf already, no need to detach": ``received.requires_grad_()`` on the caller's
own tensor.  The gradients are right, but the first stage's batch (a leaf that does not
require grad) now requires grad and collects a ``.grad`` of its own, and a leaf that
requires grad gets this stage's input gradient added to its ``.grad``.  Every test whose
input comes out of a previous stage's graph (a non-leaf) cannot tell.
"""

from __future__ import annotations

from torch import Tensor, nn

from solutions.stage import stage_backward  # noqa: F401  (stage_backward is correct)


def stage_forward(stage: nn.Module, received: Tensor) -> tuple[Tensor, Tensor]:
    if not received.is_floating_point():
        input_leaf = received
    elif received.is_leaf:
        input_leaf = received.requires_grad_(True)  # BUG: the caller's tensor, changed
    else:
        input_leaf = received.detach().requires_grad_(True)
    return input_leaf, stage(input_leaf)
