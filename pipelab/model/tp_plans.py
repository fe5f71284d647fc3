"""Tensor-parallel plans for one stage's blocks, applied with PyTorch's `parallelize_module`.

A plan is what `torch.distributed.tensor.parallel.parallelize_module(block, tp_mesh, plan)`
takes: a `ParallelStyle`, or a dict {submodule name: style}; None leaves the block replicated.
Megatron-LM's split (Shoeybi et al. 2019, §3): a column-parallel Linear followed by a
row-parallel one needs one all-reduce forward and one backward; a transformer layer has two
such pairs, so 2 all-reduces forward and 2 backward.

pl.models' blocks come with their plans (`default_plans`): `TransformerBlock` with whole heads
per rank (qkv's rows reordered by `head_grouped_rows`), `mlp`'s Linear + GELU blocks paired
inside each stage, `Embedding` and `LMHead` replicated.  A user's model passes
`tensor_parallel_plan=fn`, `fn(block)` returning a plan (or None).

Details (why qkv is reordered, the pairs inside a stage): docs/hybrid.md, "Tensor-parallel plans".
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any, Callable

import torch
from torch import nn

from ..common.errors import PipelineError
from .models import TransformerBlock


def _styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def transformer_block_plan() -> dict:
    """Megatron's split of a transformer layer: heads across ranks, then the MLP's hidden units."""
    colwise, rowwise = _styles()
    return {"qkv": colwise(), "proj": rowwise(), "mlp.0": colwise(), "mlp.2": rowwise()}


def _is_linear_block(block: nn.Module) -> bool:
    """`pl.models.mlp`'s blocks: a Linear, or Sequential(Linear, elementwise activation)."""
    if isinstance(block, nn.Linear):
        return True
    return (isinstance(block, nn.Sequential) and len(block) >= 1 and isinstance(block[0], nn.Linear)
            and not any(isinstance(m, nn.Linear) for m in list(block)[1:]))


def _linear_plan(block: nn.Module, style) -> Any:
    return style if isinstance(block, nn.Linear) else {"0": style}


def default_plans(blocks: list[nn.Module]) -> list[Any]:
    """The plans of one stage's blocks (in order), for pl.models' blocks; other blocks stay replicated.  A pair's
    column-parallel half hands the row-parallel half a DTensor (`use_local_output=False`): it knows its global
    shape, so a width tp does not divide is sharded unevenly, exactly (`check`)."""
    colwise_local, rowwise = _styles()

    def colwise():
        return colwise_local(use_local_output=False)

    plans: list[Any] = [None] * len(blocks)
    k = 0
    while k < len(blocks):
        block = blocks[k]
        if isinstance(block, TransformerBlock):
            plans[k] = transformer_block_plan()
        elif _is_linear_block(block) and k + 1 < len(blocks) and _is_linear_block(blocks[k + 1]):
            plans[k], plans[k + 1] = _linear_plan(block, colwise()), _linear_plan(blocks[k + 1], rowwise())
            k += 1
        k += 1
    return plans


def plans_for_stage(blocks: list[nn.Module], plan_fn: Callable | None) -> list[Any]:
    """`plan_fn(block)` for each block, or pl.models' plans when `plan_fn` is None."""
    if plan_fn is None:
        return default_plans(blocks)
    if not callable(plan_fn):
        raise TypeError(f"tensor_parallel_plan must be a function of a block returning its plan (or None), "
                        f"got {type(plan_fn).__name__}")
    return [plan_fn(block) for block in blocks]


def head_grouped_rows(d_model: int, tp: int) -> torch.Tensor:
    """The order of qkv's rows that gives tensor-parallel rank r, in one contiguous slice, the rows of
    q, k and v for its heads r·H/t .. (r+1)·H/t − 1:  [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    width = d_model // tp  # rows of q (or k, or v) per rank: H/t heads of d_model/H rows
    return torch.cat([c * d_model + torch.arange(r * width, (r + 1) * width) for r in range(tp) for c in range(3)])


def _planned(block: nn.Module, plan: Any) -> list[tuple[str, nn.Module, Any]]:
    """(name in the block, module, style) for every module the plan gives a style: the block itself for a
    bare style, else each key's modules, its dotted path matched part by part as `parallelize_module` does."""
    if not isinstance(plan, dict):
        return [("", block, plan)]
    found = []
    for key, style in plan.items():
        modules = [("", block)]
        for token in str(key).split("."):
            modules = [(f"{path}.{name}" if path else name, child) for path, module in modules
                       for name, child in module.named_children() if fnmatch(name, token)]
        found += [(path, module, style) for path, module in modules]
    return found


def check(block: nn.Module, plan: Any, tp: int, where: str) -> None:
    """Raise a ValueError, before DTensor sees the block, where `tensor_parallel=tp` does not divide a width its
    plan splits and DTensor would not split it exactly: a `TransformerBlock`'s heads (each rank takes whole
    heads), an Embedding's rows or dimensions, a column-parallel Linear's output features when it hands on a plain
    tensor (`use_local_output=True`, ColwiseParallel's default; see below).  A Linear's features split unevenly
    otherwise (ranks hold ⌈n/t⌉ or ⌊n/t⌋) give the single device's gradients (tests/test_bad_inputs.py)."""
    if plan is None or tp == 1:
        return
    colwise, rowwise = _styles()
    if isinstance(block, TransformerBlock) and isinstance(plan, dict) and "qkv" in plan and block.n_heads % tp:
        raise ValueError(f"{where}: tensor_parallel={tp} must divide the block's {block.n_heads} attention "
                         "heads (each rank takes whole heads)")
    for name, module, style in _planned(block, plan):
        split = _split_width(module, style, colwise, rowwise)
        if split is None or split[1] % tp == 0:
            continue
        what, width = split
        label = f"{type(module).__name__} {name}" if name else type(module).__name__
        if isinstance(module, nn.Linear) and (isinstance(style, rowwise) or not style.use_local_output):
            continue  # a DTensor in, or out: its global shape travels with it
        if isinstance(module, nn.Linear):
            raise ValueError(f"{where}: tensor_parallel={tp} does not divide the {width} output features of its "
                             f"{label}, and its ColwiseParallel hands on each rank's share as a plain tensor "
                             f"(use_local_output=True): the RowwiseParallel after it rebuilds the DTensor as if "
                             f"every share held {width} / {tp} features (DTensor.from_local without the global "
                             f"shape), and fails; pass ColwiseParallel(use_local_output=False) (pl.models' plans "
                             f"do), make them a multiple of {tp}, or leave the block replicated (its plan None)")
        raise ValueError(f"{where}: tensor_parallel={tp} must divide the {width} {what} of its {label}, which "
                         f"{type(style).__name__} splits across the tensor-parallel ranks; make them a multiple "
                         f"of {tp}, or leave the block replicated (its plan None)")


def _split_width(module: nn.Module, style: Any, colwise, rowwise) -> tuple[str, int] | None:
    """(what, how many) the style splits across the tensor-parallel ranks, or None (nothing it splits)."""
    if isinstance(module, nn.Linear):
        if isinstance(style, colwise):
            return "output features", module.out_features
        if isinstance(style, rowwise):
            return "input features", module.in_features
    if isinstance(module, nn.Embedding):
        if isinstance(style, colwise):
            return "embedding dimensions", module.embedding_dim
        if isinstance(style, rowwise):
            return "embedding rows", module.num_embeddings
    return None


def apply(block: nn.Module, plan: Any, tp_mesh, where: str) -> dict[str, torch.Tensor]:
    """Parallelize `block` in place on `tp_mesh`; return {parameter name in the block: row order} for
    the parameters whose rows were reordered (so that full gradients can be put back in order)."""
    if plan is None:
        return {}
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check(block, plan, tp, where)
    orders: dict[str, torch.Tensor] = {}
    if isinstance(block, TransformerBlock) and isinstance(plan, dict) and "qkv" in plan:
        d_model = block.proj.in_features
        order = head_grouped_rows(d_model, tp)
        with torch.no_grad():
            block.qkv.weight.copy_(block.qkv.weight[order])
            block.qkv.bias.copy_(block.qkv.bias[order])
        orders = {"qkv.weight": order, "qkv.bias": order}
    try:
        parallelize_module(block, tp_mesh, plan)
    except Exception as error:
        raise PipelineError(f"{where}: parallelize_module failed with its plan {plan!r}: "
                            f"{type(error).__name__}: {error}") from error
    return orders
