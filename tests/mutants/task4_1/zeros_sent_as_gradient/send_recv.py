"""Mutant of Task 4.1: the received activation never requires grad, so zeros go back.

Rank 1 uses the receive buffer as it is: its own parameters get their gradients, but the
buffer's ``.grad`` stays None, and the zeros sent in its place leave rank 0's stage with
zero gradients.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from solutions.send_recv import first_stage_step, post_receives  # noqa: F401  (both are correct)


def last_stage_step(
    stage: nn.Module,
    targets: list[Tensor],
    activation_shapes: list[tuple[int, ...]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    activations = post_receives(activation_shapes, peer=0)
    batch_size = sum(len(target) for target in targets)
    leaves, losses = [], []
    for k, target in enumerate(targets):
        buffer, work = activations[k]
        work.wait()
        leaves.append(buffer)  # BUG: no .requires_grad_()
        losses.append(len(target) / batch_size * loss_fn(stage(buffer), target))
    sends = []
    for k in reversed(range(len(losses))):
        losses[k].backward()
        gradient = leaves[k].grad if leaves[k].grad is not None else torch.zeros_like(leaves[k])
        sends.append(dist.isend(gradient, dst=0, tag=k))
    for work in sends:
        work.wait()
    return sum(loss.detach() for loss in losses)
