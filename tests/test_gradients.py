"""pipelab.course.gradients against PyTorch's own norm and clipping."""

import copy as copy_module

import pytest
import torch

import pipelab as pl
from pipelab.course.gradients import global_norm, gradient_norm, norm_ratio, stage_gradient_norms


def _model_with_gradients():
    model = pl.models.mlp(depth=4, width=16, seed=0)
    x, y = pl.models.sample_batch(model, 8)
    torch.nn.MSELoss()(model(x), y).backward()
    return model, x, y


def test_gradient_norm_is_the_norm_of_all_gradients_as_one_vector():
    model, _, _ = _model_with_gradients()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert gradient_norm(p.grad for p in model.parameters()) == pytest.approx(flat.norm().item(), rel=1e-6)
    assert gradient_norm([]) == 0.0


def test_global_norm_from_stage_norms_is_what_clip_grad_norm_uses():
    model, _, _ = _model_with_gradients()
    parts = pl.split(model, 2, "uniform")
    per_stage = stage_gradient_norms(parts.stages)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # returns the norm, clips nothing
    assert global_norm(per_stage) == pytest.approx(total.item(), rel=1e-6)
    assert all(n < global_norm(per_stage) for n in per_stage)


def test_clipping_per_stage_is_not_global_clipping():
    model, _, _ = _model_with_gradients()
    parts = pl.split(model, 2, "uniform")
    per_stage = stage_gradient_norms(parts.stages)
    max_norm = 0.5 * min(per_stage)
    copy = copy_module.deepcopy(model)
    for clone, original in zip(copy.parameters(), model.parameters()):
        clone.grad = original.grad.clone()
    torch.nn.utils.clip_grad_norm_(copy.parameters(), max_norm)
    for stage in parts.stages:
        torch.nn.utils.clip_grad_norm_(stage.parameters(), max_norm)
    assert global_norm(stage_gradient_norms(parts.stages)) == pytest.approx(max_norm * 2 ** 0.5, rel=1e-3)  # clip divides by norm + 1e-6
    assert gradient_norm(p.grad for p in copy.parameters()) == pytest.approx(max_norm, rel=1e-3)
    ratios = [clipped.grad.norm() / original.grad.norm() for clipped, original in
              zip(parts.stages[0].parameters(), copy[:2].parameters())]
    assert max(ratios) > 1.01  # the stage's own clip leaves its gradients larger than the global clip does


def test_norm_ratio():
    model, x, y = _model_with_gradients()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert norm_ratio(model, reference) == pytest.approx(1.0)
    for p in model.parameters():
        p.grad *= 4
    assert norm_ratio(model, reference) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="all zero"):
        norm_ratio(model, {n: torch.zeros_like(g) for n, g in reference.items()})
