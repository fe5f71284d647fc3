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
0.3 ms against 0.2 ms at n = 8, and under 10 % of the product from n = 256.  What it costs
is a Python autograd function per Linear and micro-batch, some 20-40 us forward and
backward: on small weights that is more than the pass.  Measured on one CPU thread
(`benchmarks/fused_accumulation.py`: MLP of 4 Linear(d, d) + GELU, 8 micro-batches, fused /
plain step time, three runs): with 8-row micro-batches d = 256: 1.15-1.24, d = 512:
0.85-1.01, d = 1024: 0.76-0.89, d = 2048: 0.70-0.79; with 64 rows d = 1024: 1.00-1.08,
d = 2048: 0.91-0.97.  Hence only weights of at least `MIN_WEIGHT_ELEMENTS` (512 x 512)
are fused.

Scope: the `nn.Linear` modules of a stage (their own `forward`, not a subclass's) whose
weight has at least `MIN_WEIGHT_ELEMENTS` elements and is a plain parameter (not a DTensor
or other wrapper) that requires grad and carries no hooks.  The weight gets its gradient without an `AccumulateGrad` node, so tensor hooks on
it would not run: such weights are left to plain autograd, and so is any `F.linear` called
outside a Linear module (a tied output layer) and every bias.  The result is the same sum,
rounded once per micro-batch instead of twice: equal to plain autograd within float
rounding (tested against it, `tests/test_fused_accumulation.py`).

How: while a stage's forward runs, each such Linear's `forward` is its fused version (an
instance attribute, removed after), so nothing else in the forward pays for it.  Not for a
split backward (zero bubble): there B must leave every weight gradient to W.  PyTorch's
autograd has no switch for this, hence the small autograd function below.
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
