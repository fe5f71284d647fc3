"""Mutant of Task 1.3: ``torch.autograd.grad`` instead of ``backward``.

autograd.grad returns the gradient for the inputs it is given and does not touch any
``.grad``: the gradient sent back is right, but the parameters never get theirs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from solutions.stage import stage_forward  # noqa: F401  (stage_forward is correct)


def stage_backward(input_leaf: Tensor, output: Tensor, grad_output: Tensor | None) -> Tensor | None:
    if not input_leaf.requires_grad:
        torch.autograd.backward(output, grad_output)
        return None
    (grad_input,) = torch.autograd.grad(output, input_leaf, grad_output)  # BUG: no .grad
    return grad_input
