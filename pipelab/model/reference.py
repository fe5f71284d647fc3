"""The plain single-device training step: what every pipelined step must reproduce."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def single_device_gradients(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> tuple[float, dict]:
    """Loss and a copy of every parameter's gradient for one full-batch step; `.grad` is left as it was."""
    params = dict(model.named_parameters())
    loss = loss_fn(model(inputs), targets)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return loss.item(), {name: g.detach().clone() for name, g in zip(params, grads) if g is not None}


def max_gradient_difference(model: nn.Module, reference: dict) -> float:
    """Largest |model's .grad - reference| over all parameters (0.0 when they agree exactly)."""
    worst = 0.0
    for name, param in model.named_parameters():
        if name in reference:
            if param.grad is None:
                return float("inf")
            worst = max(worst, (param.grad.detach().cpu() - reference[name].cpu()).abs().max().item())
    return worst
