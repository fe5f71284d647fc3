"""method="time" for a model split by names: the forward + backward seconds of each repeated block.

The model is traced and cut before every block (`split_by_names`), so the first piece also holds
what runs before the blocks (GPT-2's embeddings) and the last what runs after them (the final norm,
the LM head, and the model's own loss when the sample has labels).  Those costs count on the first
and the last block, the stages that will run them; `balanced_bounds` then cuts where the largest
stage is smallest.  Each piece runs as an engine's stage does by default (`stage.py`: its forward
with fused weight-gradient accumulation, then its backward from the next piece's input gradients;
the last piece from its loss, or without one from the sum of its floating-point outputs, the
loss's own cost then left out).  A piece's seconds are the best of `repeats` runs (other work only
ever adds time).  The model's `.grad` and buffers are left as they were.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from . import boundary
from . import stage as stage_ops
from .fused_accumulation import FusedAccumulation
from .named_split import model_loss, split_by_names


def block_times(model: nn.Module, blocks: str, n_blocks: int, sample: dict, repeats: int) -> list[float]:
    """Seconds of blocks `blocks`.0 .. `blocks`.(n_blocks - 1) of `model` on one micro-batch `sample` (the model's
    keyword arguments), the first and last with what runs before and after them (module docstring)."""
    pieces = split_by_names(model, [f"{blocks}.{k}" for k in range(1, n_blocks)], sample)
    times: list[list[float]] = [[] for _ in pieces]
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None
    try:
        with stage_ops.buffers_kept(model.buffers()):
            runs = [stage_ops.stage_function(piece, FusedAccumulation(piece, list(piece.parameters())),
                                             loss=loss_or_sum if s == len(pieces) - 1 else None,
                                             copy_input=stage_ops.starts_in_place(piece))
                    for s, piece in enumerate(pieces)]
            for _ in range(repeats):
                _time_once(runs, sample, times)
    finally:
        for p, grad in grads:
            p.grad = grad
    return [min(t) for t in times]


def _time_once(runs: list, sample: dict, times: list[list[float]]) -> None:
    """One forward through the pieces' `runs` (`stage.stage_function`s), then one backward, each piece timed."""
    activation, held, last = sample, [], len(runs) - 1
    for s, run in enumerate(runs):
        inp = stage_ops.as_input(activation, s == 0)
        begin = time.perf_counter()
        output, kept = stage_ops.forward(lambda x: run(x)[1 if s == last else 0], inp)  # the loss, or the output
        times[s].append(time.perf_counter() - begin)
        held.append(kept)
        activation = boundary.detached(output)
    gradient = None
    for s in reversed(range(len(runs))):
        begin = time.perf_counter()
        gradient = stage_ops.backward(held[s], gradient)
        times[s][-1] += time.perf_counter() - begin


def loss_or_sum(output: Any) -> torch.Tensor:
    """The model's own loss, or without one the sum of its floating-point outputs (a backward of the same shapes)."""
    try:
        return model_loss(output)
    except TypeError:
        return sum(t.sum() for t in boundary.tensors(output) if t.is_floating_point())
