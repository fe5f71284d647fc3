"""Task 1.3: one pipeline stage's forward and backward for one micro-batch (lesson 02)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def stage_forward(stage: nn.Module, received: Tensor) -> tuple[Tensor, Tensor]:
    """Run ``stage`` on the activation ``received`` from the previous stage.

    Each stage keeps its own autograd graph.  So that its backward stops at its own input
    (the previous stage runs its own backward, with the gradient this stage sends back),
    the received activation is cut from the previous graph and made a fresh leaf:

        input_leaf = received.detach().requires_grad_()
        output     = stage(input_leaf)

    A received tensor that is not floating point (integer token ids fed to the first
    stage) has no gradient; it is used as it is.  A floating-point one keeps its dtype
    (float32, float64, bfloat16: no cast), and ``input_leaf`` is always a new tensor, even
    when ``received`` is already a leaf (the batch fed to the first stage, or a tensor
    that requires grad): ``received`` itself is left unchanged, its ``requires_grad`` and
    ``.grad`` as they were.

    Returns:
        ``(input_leaf, output)``: keep both until :func:`stage_backward` for this
        micro-batch; send ``output`` to the next stage.
    """
    # TODO: Implement for Task 1.3.
    raise NotImplementedError("Task 1.3")


def stage_backward(input_leaf: Tensor, output: Tensor, grad_output: Tensor | None) -> Tensor | None:
    """Backpropagate one micro-batch through this stage only.

    ``grad_output`` is dLoss/d``output``, received from the next stage.  On the last
    stage ``output`` is the micro-batch's scaled loss, ``(B_k / B) * loss_k`` for a
    micro-batch of B_k of the batch's B samples, and ``grad_output`` is None.

    The stage's parameter gradients are *added* to ``.grad``, never overwritten: after the
    last micro-batch each parameter holds the gradient of the whole batch,

        p.grad = sum_k dLoss_k/dp = dLoss/dp     (gradient accumulation)

    Returns:
        dLoss/d``input_leaf`` (that is, ``input_leaf.grad``, of its shape and dtype), the
        gradient to send to the previous stage; None when the input does not require grad
        (token ids).
    """
    # TODO: Implement for Task 1.3.
    raise NotImplementedError("Task 1.3")
