"""Where split_method="auto" may cut a model: the places worth pricing, found from the model itself.

An `nn.Sequential`: between any two of its blocks.  Any other module (split by names): before each
of its repeated blocks (`named_split.repeated_blocks`), before each large part *inside* a block
(a child holding at least `LARGE_SHARE` of the block's parameters: GPT-2's `attn` and `mlp`, Llama's
`self_attn` and `mlp`; not the block's first part, which starts where the block does), and before a
large module that runs after the blocks (GPT-2's `lm_head`, which the model's own loss follows).  A
cut inside a block sends the residual stream and the part's input across, as `named_split` traces
them.  "Large" is by parameters (their count tracks the products' cost in a transformer); which cut
is *fastest* is then measured and simulated (`predict/auto_plan.py`), not guessed from the counts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .named_split import repeated_blocks

LARGE_SHARE = 0.25
"""A part holding at least this share of a block's parameters is a place to cut (attention: 1/3, MLP: 2/3)."""


def cut_points(model: nn.Module, sample: Any) -> list[str]:
    """The module names before which `model` may be cut, in the order its forward reaches them (module
    docstring); `sample` is one micro-batch, as the model's keyword arguments (one forward, no gradients)."""
    name, blocks = repeated_blocks(model)
    order = call_order(model, sample)
    per_block = [_count(block) for block in blocks]
    points: list[str] = []
    for i, block in enumerate(blocks):
        prefix = f"{name}.{i}"
        if i > 0:
            points.append(prefix)
        parts = [f"{prefix}.{child}" for child, module in block.named_children()
                 if _count(module) >= LARGE_SHARE * per_block[i] > 0 and f"{prefix}.{child}" in order]
        inside = [n for n in order if n.startswith(prefix + ".")]
        points += [p for p in sorted(parts, key=order.index) if inside and p != inside[0]]
    last = [n for n in order if n.startswith(f"{name}.{len(blocks) - 1}")]
    after = order[order.index(last[-1]) + 1:] if last else []
    large = max(per_block, default=0) * LARGE_SHARE
    for module_name in after:
        if module_name.startswith(name) or not module_name or any(module_name.startswith(p + ".") for p in points):
            continue
        if _count(model.get_submodule(module_name)) >= large > 0:
            points.append(module_name)
    return points


def call_order(model: nn.Module, sample: Any) -> list[str]:
    """Every submodule's name, in the order its forward is first called on `sample` (one no-grad forward, the
    model's buffers and mode untouched)."""
    order: list[str] = []
    seen: set[str] = set()

    def note(module_name: str):
        def hook(module, args, kwargs=None):
            if module_name not in seen:
                seen.add(module_name)
                order.append(module_name)
        return hook

    handles = [module.register_forward_pre_hook(note(n)) for n, module in model.named_modules() if n]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad():
            model(**sample) if isinstance(sample, dict) else model(sample)
    finally:
        for handle in handles:
            handle.remove()
        for b, kept in buffers:
            b.copy_(kept)
    return order


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
