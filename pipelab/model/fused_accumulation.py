"""Weight gradients accumulated inside the matrix multiply (gradient-accumulation fusion).

With m micro-batches a Linear's weight gradient is a sum over them, dW = sum_i g_i^T x_i.
Plain autograd computes each term into a new tensor and then adds it to `weight.grad`
(`AccumulateGrad`): one extra pass over the weight per micro-batch.  Here the multiply adds
its product into `weight.grad` itself, `weight.grad.addmm_(g_i^T, x_i)`, as Megatron-LM's
`--gradient-accumulation-fusion` does on GPUs.  Equal to plain autograd within float
rounding (`tests/test_fused_accumulation.py`).

Only weights of at least `MIN_WEIGHT_ELEMENTS` (512 x 512) that are plain parameters requiring
grad, without hooks, are fused, and never under a split backward: those of `nn.Linear` modules,
and in a model split by names (a traced graph) those of its `aten.linear(x, W, b)` and
`aten.addmm(b, x, W)` (transformers' `Conv1D`: W is (in, out), dW = x^T g).
Why that threshold (the ratios by layer width that `benchmarks/fused_accumulation.py`
prints), the full scope and how it is switched on: docs/engines.md, "Fused weight-gradient
accumulation".
"""

from __future__ import annotations

from contextvars import ContextVar
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


class _AddmmAccumulatingWeightGrad(torch.autograd.Function):
    """y = b + x W for a 2-D x and W of shape (in, out), whose backward adds x^T g into `W.grad`."""

    @staticmethod
    def forward(ctx, bias, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.parameter, ctx.bias_shape = weight, bias.shape
        return torch.addmm(bias, x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.mm(weight.t()) if ctx.needs_input_grad[1] else None
        grad_bias = grad_out.sum_to_size(ctx.bias_shape) if ctx.needs_input_grad[0] else None  # undo the broadcast
        parameter = ctx.parameter
        if parameter.grad is None:
            parameter.grad = x.t().mm(grad_out)
        else:
            parameter.grad.addmm_(x.t(), grad_out)
        return grad_bias, grad_x, None


_TRACED_FUSED: ContextVar[frozenset[int]] = ContextVar("pipelab_traced_fused", default=frozenset())
"""The ids of the traced weights that accumulate in the multiply, for the `with FusedAccumulation` that set it."""


def traced_linear(x, weight, bias=None):
    """A traced graph's `aten.linear`, fused where the `with FusedAccumulation` around it says so."""
    if id(weight) in _TRACED_FUSED.get() and _fuses(weight, x):
        return _LinearAccumulatingWeightGrad.apply(x, weight, bias)
    return torch.ops.aten.linear.default(x, weight, bias)


def traced_addmm(bias, x, weight):
    """A traced graph's `aten.addmm` (transformers' `Conv1D`), fused where the `with FusedAccumulation` says so."""
    if id(weight) in _TRACED_FUSED.get() and _fuses(weight, x):
        return _AddmmAccumulatingWeightGrad.apply(bias, x, weight)
    return torch.ops.aten.addmm.default(bias, x, weight)


_WEIGHT_POSITION = {torch.ops.aten.linear.default: 1, torch.ops.aten.addmm.default: 2}  # where W is in the args


def route_weight_multiplies(graph_module: torch.fx.GraphModule, weight_placeholders: set[str]) -> list[str]:
    """Point the graph's `aten.linear(x, W, b)` and `aten.addmm(b, x, W)` whose W is one of the placeholders
    named in `weight_placeholders` (the stage's parameters) at `traced_linear` / `traced_addmm`, which run them
    as traced unless a `with FusedAccumulation` fuses that weight.  Returns the placeholders routed."""
    routed = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        position = _WEIGHT_POSITION.get(node.target)
        if position is None or len(node.args) <= position:
            continue
        weight = node.args[position]
        if isinstance(weight, torch.fx.Node) and weight.op == "placeholder" and weight.name in weight_placeholders:
            node.target = traced_linear if position == 1 else traced_addmm
            routed.append(weight.name)
    if routed:
        graph_module.recompile()
    return routed


def _fuses(weight, x) -> bool:
    """Whether this call may add into `weight.grad` itself: a gradient is being recorded, the weight qualifies,
    and the input is a plain tensor."""
    return torch.is_grad_enabled() and _fusable(weight) and not is_traceable_wrapper_subclass(x)


def _fusable(weight) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.is_leaf and weight.requires_grad
            and not is_traceable_wrapper_subclass(weight)
            and not getattr(weight, "_backward_hooks", None)
            and not getattr(weight, "_post_accumulate_grad_hooks", None))


def _fused_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _fuses(linear.weight, x):
        return _LinearAccumulatingWeightGrad.apply(x, linear.weight, linear.bias)
    return F.linear(x, linear.weight, linear.bias)


class FusedAccumulation:
    """`with FusedAccumulation(module, parameters):` the Linear layers of `module` whose weight is among
    `parameters` (and qualifies, see the module docstring) accumulate their weight gradients in the
    multiply, and so do the routed multiplies of its traced stages (`routed_weights`, set by
    `pipelab.model.named_split`).  Built once per stage; entered around each of its forwards."""

    def __init__(self, module: nn.Module, parameters, min_weight_elements: int | None = None):
        wanted = {id(p) for p in parameters}
        smallest = MIN_WEIGHT_ELEMENTS if min_weight_elements is None else min_weight_elements
        self.linears = [m for m in module.modules()
                        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
                        and id(m.weight) in wanted and m.weight.numel() >= smallest]
        self.traced = frozenset(id(w) for m in module.modules() for w in getattr(m, "routed_weights", ())
                                if id(w) in wanted and w.numel() >= smallest)
        self._tokens = []

    def __enter__(self) -> "FusedAccumulation":
        for linear in self.linears:
            linear.forward = partial(_fused_forward, linear)
        self._tokens.append(_TRACED_FUSED.set(self.traced))
        return self

    def __exit__(self, *exc) -> None:
        for linear in self.linears:
            linear.__dict__.pop("forward", None)
        _TRACED_FUSED.reset(self._tokens.pop())
