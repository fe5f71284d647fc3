"""Mutant of Task 1.3: the input leaf made with ``received.detach().float()``.

Fine in float32; a float64 or bfloat16 stage then gets a float32 input (a dtype error,
or silently a float32 computation), and the gradient sent back is float32 too.
"""

from __future__ import annotations

from torch import Tensor, nn

from solutions.stage import stage_backward  # noqa: F401  (stage_backward is correct)


def stage_forward(stage: nn.Module, received: Tensor) -> tuple[Tensor, Tensor]:
    if received.is_floating_point():
        input_leaf = received.detach().float().requires_grad_(True)  # BUG: .float()
    else:
        input_leaf = received
    return input_leaf, stage(input_leaf)
