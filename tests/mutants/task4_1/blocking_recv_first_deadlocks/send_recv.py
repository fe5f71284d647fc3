"""Mutant of Task 4.1: blocking calls, and rank 0 receives before it sends.

Rank 0 runs one micro-batch at a time: forward, then wait (``dist.recv``) for that
micro-batch's gradient, then send its activation.  Rank 1 is waiting for that activation
at the same time.  Each rank waits for the other: a deadlock, stopped by the deadline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from solutions.send_recv import last_stage_step, post_receives  # noqa: F401  (both are correct)


def first_stage_step(stage: nn.Module, microbatches: list[Tensor], activation_shapes: list[tuple[int, ...]]) -> None:
    for k, microbatch in enumerate(microbatches):
        output = stage(microbatch)
        gradient = torch.empty(activation_shapes[k])
        dist.recv(gradient, src=1, tag=k)  # BUG: waits for gradient k before activation k has gone
        dist.send(output.detach(), dst=1, tag=k)
        output.backward(gradient)
