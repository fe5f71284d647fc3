"""Weight gradients accumulated inside the matrix multiply (gradient-accumulation fusion).

With m micro-batches a Linear's weight gradient is a sum over them, dW = sum_i g_i^T x_i.
Plain autograd computes each term into a new tensor and then adds it to `weight.grad`
(`AccumulateGrad`): one extra pass over the weight per micro-batch.  Here the multiply adds
its product into `weight.grad` itself, `weight.grad.addmm_(g_i^T, x_i)`, as Megatron-LM's
`--gradient-accumulation-fusion` does on GPUs.  Equal to plain autograd within float
rounding (`tests/test_fused_accumulation.py`).

Only `nn.Linear` weights of at least `MIN_WEIGHT_ELEMENTS` (512 x 512) that are plain
parameters requiring grad, without hooks, are fused, and never under a split backward.
Why that threshold (the ratios by layer width that `benchmarks/fused_accumulation.py`
prints), the full scope and how it is switched on: docs/engines.md, "Fused weight-gradient
accumulation".
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

MIN_WEIGHT_ELEMENTS = 512 * 512  # smaller weights: the autograd function costs more than the pass it saves


class _LinearAccumulatingWeightGrad(torch.autograd.Function):
    """y = x W^T + b, whose backward adds g^T x into `W.grad` and returns no gradient for W."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)  # what autograd's own linear saves (the weight is a parameter)
        ctx.parameter = weight  # the Parameter itself: what is saved may come back as a detached alias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        rows_out = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = rows_out.sum(0) if ctx.needs_input_grad[2] else None
        parameter = ctx.parameter
        rows_in = x.reshape(-1, x.shape[-1])
        if parameter.grad is None:
            parameter.grad = rows_out.t().mm(rows_in)
        else:
            parameter.grad.addmm_(rows_out.t(), rows_in)
        return grad_x, None, grad_bias


def _fusable(weight) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.is_leaf and weight.requires_grad
            and not is_traceable_wrapper_subclass(weight)
            and not getattr(weight, "_backward_hooks", None)
            and not getattr(weight, "_post_accumulate_grad_hooks", None))


def _fused_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled() or not _fusable(linear.weight) or is_traceable_wrapper_subclass(x):
        return F.linear(x, linear.weight, linear.bias)
    return _LinearAccumulatingWeightGrad.apply(x, linear.weight, linear.bias)


class FusedAccumulation:
    """`with FusedAccumulation(module, parameters):` the Linear layers of `module` whose weight is among
    `parameters` (and qualifies, see the module docstring) accumulate their weight gradients in the
    multiply.  Built once per stage; entered around each of its forwards."""

    def __init__(self, module: nn.Module, parameters, min_weight_elements: int | None = None):
        wanted = {id(p) for p in parameters}
        smallest = MIN_WEIGHT_ELEMENTS if min_weight_elements is None else min_weight_elements
        self.linears = [m for m in module.modules()
                        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
                        and id(m.weight) in wanted and m.weight.numel() >= smallest]

    def __enter__(self) -> "FusedAccumulation":
        for linear in self.linears:
            linear.forward = partial(_fused_forward, linear)
        return self

    def __exit__(self, *exc) -> None:
        for linear in self.linears:
            linear.__dict__.pop("forward", None)
