"""What a failed forward adds to its message: what the stage's blocks expected, and what they got.

`StageWorker.explain` (`loop.py`) asks, in order: did the stage receive a model output where a
tensor was expected (`output_hint`), does its input not fit its first block's Linear or
LayerNorm (`shape_hint`), did a block hand the next one a tuple (`non_tensor_hint`)?  Each
answers with one line, or "" when it has nothing to say.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..model.stage import buffers_kept


def output_hint(arrived: Any, stage: int) -> str:
    """When a stage received a model output (a `ModelOutput`) where its blocks expected a tensor: which field."""
    fields = [name for name in ("logits", "last_hidden_state") if getattr(arrived, name, None) is not None]
    if isinstance(arrived, torch.Tensor) or not fields:
        return ""
    return (f"stage {stage} received a {type(arrived).__name__}, not a tensor: have the previous stage return its "
            + " or ".join(f".{name}" for name in fields))


def _first_layer(block: nn.Module) -> nn.Module | None:
    return next((m for m in block.modules() if isinstance(m, (nn.Linear, nn.LayerNorm))), None)


def _features(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.normalized_shape[-1]


def shape_hint(module: nn.Module, first_block: int, arrived: Any, from_stage: int | None, stage: int) -> str:
    """Say what the stage's first block expected, when its first Linear or LayerNorm does not fit the input
    (its feature size, or its dtype): only on a real mismatch, and only for a `Sequential` of blocks."""
    if not isinstance(arrived, torch.Tensor) or arrived.dim() == 0 or not isinstance(module, nn.Sequential) \
            or len(module) == 0:
        return ""
    block = module[0]
    layer = _first_layer(block)
    if layer is None:
        return ""
    expected = _features(layer)
    origin = "the input batch" if from_stage is None else f"stage {from_stage}'s output"
    got = f"stage {stage} received {origin} of shape {tuple(arrived.shape)} ({arrived.dtype}); "
    if arrived.shape[-1] != expected:
        return got + (f"block {first_block} ({type(block).__name__}) expects {expected} features "
                      "in the last dimension")
    weight = getattr(layer, "weight", None)
    if weight is not None and arrived.dtype != weight.dtype:
        return got + f"block {first_block} ({type(block).__name__}) computes in {weight.dtype}"
    return ""


def non_tensor_hint(module: nn.Module, first_block: int, arrived: Any, from_stage: int | None) -> str:
    """When a block gets a tuple (or any value not a tensor) although its first layer, a Linear or a LayerNorm,
    takes one tensor: which block returned it, what it is, and what the next block expects.  Found by running the
    stage's blocks again on `arrived` (a copy of the stage's input), without a graph, buffers and random state
    kept; only for a `Sequential` of blocks."""
    if not isinstance(module, nn.Sequential):
        return ""
    devices = [t.device for t in module.parameters() if t.device.type == "cuda"][:1]
    value = arrived
    with torch.no_grad(), buffers_kept(module.buffers()), torch.random.fork_rng(devices=devices):
        for k, block in enumerate(module):
            layer = _first_layer(block)
            if not isinstance(value, torch.Tensor) and layer is not None:
                if k == 0 and from_stage is None:
                    source, fix = "the input batch is", "give one tensor as the input"
                else:
                    producer = first_block + k - 1
                    source = (f"block {producer} ({type(module[k - 1]).__name__}) returns" if k > 0 else
                              f"block {producer}, the last of stage {from_stage}, returns")
                    fix = f"have block {producer} return one tensor (e.g. its output[0])"
                return (f"{source} {_described(value)}, but block {first_block + k} ({type(block).__name__}) expects "
                        f"one tensor of {_features(layer)} features in the last dimension: {fix}, or have block "
                        f"{first_block + k} take the {type(value).__name__} apart")
            try:
                value = block(value)
            except Exception:
                return ""
    return ""


def _described(value: Any) -> str:
    """'a tuple of 2 (tensor (4, 8), tensor (4,))'."""
    def one(item: Any) -> str:
        return f"tensor {tuple(item.shape)}" if isinstance(item, torch.Tensor) else type(item).__name__

    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(one(item) for item in value)})"
    return f"a {type(value).__name__}"
