"""Mutant of Task 1.3: the received activation is not detached.

The stage's backward then runs on through the previous stages' graphs (their
parameters get gradients twice), and input_leaf.grad stays None because the received
tensor is not a leaf.
"""

from __future__ import annotations

from torch import Tensor, nn

from solutions.stage import stage_backward  # noqa: F401  (stage_backward is correct)


def stage_forward(stage: nn.Module, received: Tensor) -> tuple[Tensor, Tensor]:
    if received.is_floating_point():
        input_leaf = received.requires_grad_(True)  # BUG: no .detach()
    else:
        input_leaf = received
    return input_leaf, stage(input_leaf)
