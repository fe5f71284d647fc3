"""Task 4.2: column- and row-parallel linear layers for tensor parallelism (lesson 08).

A Linear y = x Wᵀ + b (W of shape out × in) split over the t ranks of a group, Megatron-LM
style (Shoeybi et al. 2019, §3):

- **column-parallel**: rank r holds rows r·out/t .. of W (and of b): it computes its slice
  of the output's features, y_r = x W_rᵀ + b_r, from the whole input x (the same on every
  rank).  Forward: no communication.  Backward: each rank's x.grad is only its slice's
  contribution, W_rᵀ-sized; the full gradient of x is their sum — an all-reduce.
- **row-parallel**: rank r holds columns r·in/t .. of W: from its slice x_r of the input's
  features it computes a partial output x_r W_rᵀ; the output is the sum over ranks — an
  all-reduce — and b is added once, after it.  Backward: the output's gradient is the same
  on every rank; x_r.grad and W_r.grad follow locally.

The two communications are two tiny autograd Functions, Megatron's f and g:

    f = copy_to_parallel_region:      forward identity,     backward all-reduce
    g = reduce_from_parallel_region:  forward all-reduce,   backward identity

so column_parallel(x) = f(x) W_rᵀ + b_r and row_parallel(x_r) = g(x_r W_rᵀ) + b.  A
column-parallel layer followed by a row-parallel one (an MLP: fc1, GELU, fc2) needs one
all-reduce forward and one backward, and the activation between them stays split.

Both sum over the group they are given, and only over it: with tensor parallelism inside
a pipeline or beside data parallelism, the world holds several tensor-parallel groups
(``dist.new_group``), and an all-reduce over the default group would mix them.  f's
backward keeps its group from the forward (in ``ctx``).  Neither changes a tensor its
caller still holds: ``dist.all_reduce`` works in place, so each reduces a copy (g's
input; the gradient f's backward is handed, which autograd may pass to another path as
well, as in a residual f(x) + x).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward; backward, the sum over the group of the incoming gradients (all-reduce).

    Over ``group`` only (kept in ``ctx`` for the backward); the incoming gradient is not
    changed in place (a residual f(x) + x hands the same tensor to x's other path).
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        # TODO: Implement for Task 4.2.
        raise NotImplementedError("Task 4.2")

    @staticmethod
    def backward(ctx, grad: Tensor):
        # TODO: Implement for Task 4.2.
        raise NotImplementedError("Task 4.2")


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: forward, the sum over the group (all-reduce); backward identity.

    Over ``group`` only; the input is not changed in place (the caller may still hold it).
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        # TODO: Implement for Task 4.2.
        raise NotImplementedError("Task 4.2")

    @staticmethod
    def backward(ctx, grad: Tensor):
        # TODO: Implement for Task 4.2.
        raise NotImplementedError("Task 4.2")


def column_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group=None) -> Tensor:
    """This rank's slice of the output features: f(x) @ weightᵀ + bias.

    Args:
        x: the whole input (batch..., in), the same on every rank of `group`.
        weight: this rank's rows of W, (out / t, in).
        bias: this rank's slice of b, (out / t,), or None.
        group: the tensor-parallel process group (None: the whole world); every all-reduce
            runs over it, and only over it.

    Returns:
        (batch..., out / t): features r·out/t .. (r+1)·out/t − 1 of x Wᵀ + b.
    """
    # TODO: Implement for Task 4.2.
    raise NotImplementedError("Task 4.2")


def row_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group=None) -> Tensor:
    """The whole output from this rank's slice of the input features: g(x @ weightᵀ) + bias.

    Args:
        x: this rank's slice of the input features, (batch..., in / t).
        weight: this rank's columns of W, (out, in / t).
        bias: the whole b, (out,), the same on every rank (added once, after the sum), or None.
        group: the tensor-parallel process group (None: the whole world); every all-reduce
            runs over it, and only over it.

    Returns:
        (batch..., out): x Wᵀ + b of the whole input, on every rank.
    """
    # TODO: Implement for Task 4.2.
    raise NotImplementedError("Task 4.2")

