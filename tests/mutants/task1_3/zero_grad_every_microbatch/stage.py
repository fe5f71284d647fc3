"""Mutant of Task 1.3: ``zero_grad()`` for every micro-batch, so .grad is overwritten.

Harmless in GPipe order (all forwards come before any backward), wrong as soon as a
forward follows a backward (1F1B): only the last micro-batches' gradients survive.
"""

from __future__ import annotations

from torch import Tensor, nn

from solutions.stage import stage_backward  # noqa: F401  (stage_backward is correct)


def stage_forward(stage: nn.Module, received: Tensor) -> tuple[Tensor, Tensor]:
    stage.zero_grad()  # BUG: throws away the gradients of earlier micro-batches
    if received.is_floating_point():
        input_leaf = received.detach().requires_grad_(True)
    else:
        input_leaf = received
    return input_leaf, stage(input_leaf)
