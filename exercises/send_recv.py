"""Task 4.1: send/recv of activations and gradients between two ranks (lesson 06).

A model cut into two stages runs on two processes: rank 0 holds the first stage, rank 1
the last.  One GPipe step on m micro-batches sends m activations forward and m gradients
back over the one link between them (here m = 3):

    clock     1   2   3   4   5   6   7   8
    rank 0    F0  F1  F2  .   .   B2  B1  B0     sends activations a0 a1 a2, then waits for g2 g1 g0
    rank 1    .   F0  F1  F2  B2  B1  B0  .      waits for a0 a1 a2, sends gradients g2 g1 g0

Point-to-point calls only: ``dist.isend`` and ``dist.irecv`` return at once with a work
object, and ``work.wait()`` blocks until that message has gone or arrived.  Each message
is tagged with its micro-batch index k, so that it can never land in the buffer of
another micro-batch.  (Not ``dist.batch_isend_irecv``: on gloo it has no stable
implementation and can hang, pytorch/PiPPy#1130.)

The world may hold more ranks than these two, which send messages of their own, with the
same tags: each receive names its source (``src=peer``), or it may take another rank's.

Both ranks know every message's shape before it is sent: ``activation_shapes[k]`` is the
shape of micro-batch k's activation, and its gradient has the same shape.  So a receive
can be posted before its message exists, into a buffer of the right size.

Deadlock-free: a rank blocks only in ``wait()``, and only for a message the other rank
sends without waiting for anything first (rank 0 sends every activation before it waits
for a gradient).  Two blocking receives, one on each rank, each waiting for the other's
send, never return.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn


def post_receives(shapes: list[tuple[int, ...]], peer: int) -> list[tuple[Tensor, dist.Work]]:
    """Post one receive from rank ``peer`` per micro-batch, before anything is sent.

    For micro-batch k: a float32 buffer ``torch.empty(shapes[k])`` and
    ``dist.irecv(buffer, src=peer, tag=k)``.  ``irecv`` returns at once; the message is
    in the buffer after ``work.wait()``.  From ``peer`` only: another rank of the world
    may send with the same tags, and a receive without ``src`` takes whichever comes first.

    Returns:
        ``[(buffer_k, work_k), ...]``, in micro-batch order k = 0 .. m-1.
    """
    # TODO: Implement for Task 4.1.
    raise NotImplementedError("Task 4.1")


def first_stage_step(stage: nn.Module, microbatches: list[Tensor], activation_shapes: list[tuple[int, ...]]) -> None:
    """Rank 0's part of one GPipe step: forward and send every activation, then backward
    each micro-batch with the gradient rank 1 sends back.

    1. post the receives of the m gradients from rank 1 (:func:`post_receives`);
    2. for k = 0 .. m-1: ``output_k = stage(microbatches[k])``; send ``output_k.detach()``
       with ``dist.isend(..., dst=1, tag=k)`` (no waiting: keep its work);
    3. for k = m-1 .. 0: wait for gradient k, then ``output_k.backward(gradient_k)``
       (the stage's ``.grad`` add up over the micro-batches);
    4. wait for every send (a tensor must stay alive until its send has completed):
       ``work.wait()`` on each work ``dist.isend`` returned, before returning.

    ``activation_shapes[k]`` is ``output_k``'s shape; the inputs are not modified: the
    micro-batches keep their ``requires_grad`` and get no ``.grad`` (they are not made leaves
    of this step; only the stage's parameters get gradients).

    Returns:
        None: the result is in the stage's parameters' ``.grad``.
    """
    # TODO: Implement for Task 4.1.
    raise NotImplementedError("Task 4.1")


def last_stage_step(
    stage: nn.Module,
    targets: list[Tensor],
    activation_shapes: list[tuple[int, ...]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """Rank 1's part of one GPipe step: receive each activation, forward and compute the
    loss, then backward and send each activation's gradient back to rank 0.

    1. post the receives of the m activations from rank 0 (:func:`post_receives`);
    2. for k = 0 .. m-1: wait for activation k; make the buffer a leaf that requires grad
       (``buffer.requires_grad_()``); ``output_k = stage(leaf_k)`` and the micro-batch's
       share of the batch loss, for B_k = len(targets[k]) of the B samples,

           loss_k = (B_k / B) * loss_fn(output_k, targets[k])

    3. for k = m-1 .. 0: ``loss_k.backward()``, then send ``leaf_k.grad`` (dLoss/d
       activation k) with ``dist.isend(..., dst=0, tag=k)``;
    4. wait for every send: ``work.wait()`` on each work ``dist.isend`` returned, before
       returning.

    ``activation_shapes[k]`` is the shape of activation k; the inputs are not modified: the
    targets keep their ``requires_grad`` and get no ``.grad``.

    Returns:
        the batch's loss, sum_k loss_k, detached: a 0-dim tensor.
    """
    # TODO: Implement for Task 4.1.
    raise NotImplementedError("Task 4.1")
