"""`pl.single_device_gradients` / `pl.max_gradient_difference`, used by lesson 02."""

import torch
from torch import nn

import pipelab as pl


def test_reference_gradients_leave_grad_untouched_and_match_backward():
    model = pl.models.mlp(depth=3, width=4, seed=0)
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    loss, grads = pl.single_device_gradients(model, x, y, nn.MSELoss())
    assert all(p.grad is None for p in model.parameters())
    nn.MSELoss()(model(x), y).backward()
    assert pl.max_gradient_difference(model, grads) == 0.0
    next(model.parameters()).grad += 0.5
    assert pl.max_gradient_difference(model, grads) == 0.5
    assert isinstance(loss, float)


def test_missing_gradient_is_infinitely_different():
    model = pl.models.mlp(depth=2, width=3)
    _, grads = pl.single_device_gradients(model, torch.randn(2, 3), torch.randn(2, 3), nn.MSELoss())
    assert pl.max_gradient_difference(model, grads) == float("inf")


def test_about_reports_the_installation():
    info = pl.about()
    assert info["torch"] == torch.__version__
    assert ("GPU" in info["stages will run on"]) == torch.cuda.is_available()
    assert "torch" in pl.describe()
