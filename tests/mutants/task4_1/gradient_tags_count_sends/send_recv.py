"""Mutant of Task 4.1: gradients tagged by the order they are sent, not by micro-batch.

Rank 1 sends the gradients in backward order (m-1 first) with tags 0, 1, ...: the
gradient of micro-batch m-1 lands in micro-batch 0's buffer on rank 0.  Right for m = 1
only.
"""

from __future__ import annotations

from typing import Callable

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
        leaves.append(buffer.requires_grad_())
        losses.append(len(target) / batch_size * loss_fn(stage(leaves[k]), target))
    sends = []
    for k in reversed(range(len(losses))):
        losses[k].backward()
        sends.append(dist.isend(leaves[k].grad, dst=0, tag=len(sends)))  # BUG: the send's number
    for work in sends:
        work.wait()
    return sum(loss.detach() for loss in losses)
