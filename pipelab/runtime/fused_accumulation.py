"""Weight gradients accumulated inside the matrix multiply (gradient-accumulation fusion).

With m micro-batches a Linear's weight gradient is a sum over them,
dW = sum_i g_i^T x_i (g_i the gradient at the output, x_i the input of micro-batch i).
Plain autograd computes each term into a new tensor and then adds it to `weight.grad`
(`AccumulateGrad`): per micro-batch one extra pass over out x in values, read twice and
written once.  Here the multiply adds its product into `weight.grad` itself,
`weight.grad.addmm_(g_i^T, x_i)` (beta = 1), so the sum costs no extra pass.  Megatron-LM does
the same on GPUs (`--gradient-accumulation-fusion`, a fused wgrad GEMM into `main_grad`).

What it saves is that extra pass, against the product: for an n-row micro-batch of a
d x d Linear, the pass touches 3 d^2 values, the product does 2 n d^2 flops.  On one CPU
thread (Linear(1024, 1024), `benchmarks/vs_torch_pipelining.py`'s model) that is about
0.3 ms against 0.2 ms at n = 8, and under 10 % of the product from n = 256.

Scope: only `F.linear` calls (every `nn.Linear`) whose weight is one of the stage's plain
parameters (not a DTensor or other wrapper), that requires grad and carries no hooks.  The
weight gets its gradient without an `AccumulateGrad` node, so tensor hooks on it would not
run: such weights are left to plain autograd.  The bias (d values) stays with autograd.
The result is the same sum, rounded once per micro-batch instead of twice: equal to plain
autograd within float rounding (tested against it, `tests/test_fused_accumulation.py`).

Not for a split backward (zero bubble): there B must leave every weight gradient to W.
PyTorch's autograd has no switch for this, hence the small autograd function below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


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


class FusedAccumulation(TorchFunctionMode):
    """Inside `with FusedAccumulation(parameters):`, a Linear whose weight is among `parameters`
    accumulates its weight gradient in the multiply (see the module docstring); everything else
    runs unchanged."""

    def __init__(self, parameters):
        super().__init__()
        self.weights = {id(p) for p in parameters if _fusable(p)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self.weights and torch.is_grad_enabled():
            named = [kwargs.get("input"), kwargs.get("weight"), kwargs.get("bias")]
            x, weight, bias = (list(args) + named[len(args):])[:3]
            if (id(weight) in self.weights and isinstance(x, torch.Tensor) and x.dim() >= 1
                    and not is_traceable_wrapper_subclass(x)):
                return _LinearAccumulatingWeightGrad.apply(x, weight, bias)
        return func(*args, **kwargs)
