"""Mutant of Task 1.3: "floating point" tested as ``received.dtype == torch.float32``.

Right for every float32 activation.  A float64 or bfloat16 activation is taken for
token ids and used as it is: it is not detached, so this stage's backward runs on into
the previous stage's graph, and no gradient is returned for the previous stage.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from solutions.stage import stage_backward  # noqa: F401  (stage_backward is correct)


def stage_forward(stage: nn.Module, received: Tensor) -> tuple[Tensor, Tensor]:
    if received.dtype == torch.float32:  # BUG: received.is_floating_point()
        input_leaf = received.detach().requires_grad_(True)
    else:
        input_leaf = received
    return input_leaf, stage(input_leaf)
