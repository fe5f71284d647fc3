"""Gradient norms across pipeline stages: what a global clip needs from every stage.

Clipping by the global norm (torch.nn.utils.clip_grad_norm_) scales every gradient by
max_norm / ||g|| with ||g||² = Σ_s ||g_s||², the squares of *all* stages' norms added up.
A stage alone knows only its own ||g_s||; in a pipeline with one process per stage the
squares are summed with an all-reduce over the pipeline group (Megatron-LM's
`clip_grad_norm_fp32` does this over its model-parallel group).  Clipping each stage by its
own norm gives a different update.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def gradient_norm(gradients: Iterable[torch.Tensor]) -> float:
    """The 2-norm of all the given gradients as one vector (torch.nn.utils.get_total_norm)."""
    gradients = [g.detach() for g in gradients if g is not None]
    if not gradients:
        return 0.0
    return torch.nn.utils.get_total_norm(gradients, norm_type=2.0).item()


def stage_gradient_norms(stages: Iterable[nn.Module]) -> list[float]:
    """Each stage's own gradient norm ||g_s|| (the parameters' `.grad`; a stage without gradients has 0)."""
    return [gradient_norm(p.grad for p in stage.parameters()) for stage in stages]


def global_norm(stage_norms: Iterable[float]) -> float:
    """sqrt(Σ_s ||g_s||²): the norm of the whole model's gradient from the stages' own norms."""
    return float(sum(n * n for n in stage_norms)) ** 0.5


def norm_ratio(model: nn.Module, reference: dict) -> float:
    """||model's .grad|| / ||reference gradients||: 1.0 for the right step, 4.0 for four unweighted micro-batch means."""
    reference_norm = gradient_norm(reference.values())
    if reference_norm == 0:
        raise ValueError("the reference gradients are all zero: a ratio to them is undefined")
    return gradient_norm(p.grad for name, p in model.named_parameters() if name in reference) / reference_norm
