"""What crosses a stage boundary: any nested structure of tensors and other values.

A stage may return a tensor, a tuple, a dict, a `ModelOutput` or any structure PyTorch's pytree
flattens, holding tensors and other values (ints, `None`, strings).  What travels is that
structure with every tensor detached from the sender's graph.  On the receiving stage every
floating-point (or complex) tensor becomes a leaf that requires grad: its gradient is what goes
back, in the same structure (`None` where nothing goes back).  Integer and boolean tensors
(token ids, masks, positions) travel without gradients.  A lone tensor, the common case, skips
pytree (a few microseconds per call, several calls per action).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


def differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree`, in pytree order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def detached(tree: Any) -> Any:
    """`tree` with every tensor detached: what a stage sends on."""
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree)


def as_leaves(tree: Any) -> Any:
    """What a stage computes from: every float tensor it received made a leaf that requires grad."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().requires_grad_(True) if differentiable(tree) else tree
    return tree_map(lambda v: v.detach().requires_grad_(True) if differentiable(v) else v, tree)


def input_gradients(tree: Any) -> Any:
    """The gradients to send back: `tree`'s structure, each leaf that required grad replaced by its `.grad`
    (None where it got none), every other value by None.  None when nothing goes back."""
    if isinstance(tree, torch.Tensor):
        return tree.grad if tree.requires_grad else None
    flat, spec = tree_flatten(tree)
    grads = [leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None for leaf in flat]
    if all(g is None for g in grads):
        return None
    return tree_unflatten(grads, spec)


def roots(output: Any) -> list[tuple[int, torch.Tensor]]:
    """(position in pytree order, tensor) of every output tensor that requires grad: where a backward starts."""
    if isinstance(output, torch.Tensor):
        return [(0, output)] if output.requires_grad else []
    return [(k, leaf) for k, leaf in enumerate(tree_flatten(output)[0])
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad]


def at(tree: Any, positions: list[int]) -> list[Any]:
    """The leaves of `tree` at these positions of its pytree order (all None when `tree` is None)."""
    if tree is None:
        return [None] * len(positions)
    flat = [tree] if isinstance(tree, torch.Tensor) else tree_flatten(tree)[0]
    return [flat[k] for k in positions]


def moved(tree: Any, device: torch.device, copy: bool) -> Any:
    """`tree` with every tensor on `device`: a copy (`.to` another device, else `.clone()` when `copy`)."""
    def move(value):
        if not isinstance(value, torch.Tensor):
            return value
        if value.device != device:
            return value.to(device)
        return value.clone() if copy else value
    return move(tree) if isinstance(tree, torch.Tensor) else tree_map(move, tree)


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(tree))
