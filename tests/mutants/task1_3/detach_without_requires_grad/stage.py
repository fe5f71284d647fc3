"""Mutant of Task 1.3: detached, but the new leaf does not require grad.

The stage's own parameters get their gradients, but no gradient is sent back: every
earlier stage keeps .grad = None.
"""

from __future__ import annotations

from torch import Tensor, nn

from solutions.stage import stage_backward  # noqa: F401  (stage_backward is correct)


def stage_forward(stage: nn.Module, received: Tensor) -> tuple[Tensor, Tensor]:
    input_leaf = received.detach()  # BUG: forgot .requires_grad_()
    return input_leaf, stage(input_leaf)
