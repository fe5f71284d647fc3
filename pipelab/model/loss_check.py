"""The loss's output and target shapes, checked where the loss is taken (the last stage's forward).

PyTorch's elementwise losses (`nn.MSELoss`, `L1Loss`, `SmoothL1Loss`, `HuberLoss`, ...) compare
each output value with the target value at the same position; given a target of another shape
that broadcasts (a target of shape (B, 1) for an output of (B, 16), or (B,) for (B, 1), which
gives (B, B)), most only warn and return a wrong loss.  `checked` wraps the loss a pipeline calls:

- an elementwise torch loss given an output and a target of different shapes raises
  `TargetShapeError` (a `ValueError`) naming both, before the loss is computed; a loss
  that broadcasts on purpose is wrapped in a function (`lambda out, y: F.mse_loss(out, y)`),
  which is not checked;
- any other loss that fails on a tensor output and a tensor target fails with the same
  exception type, its message naming both shapes.

Either is raised inside the stage's forward, so the loop adds the stage, action and
micro-batch (a `PipelineError`); `usage_errors` makes the shape mismatch a `LossShapeError`
there, a `PipelineError` that is also a `ValueError`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from ..common.errors import PipelineError

ELEMENTWISE = (nn.L1Loss, nn.MSELoss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.KLDivLoss,
               nn.PoissonNLLLoss, nn.SoftMarginLoss, nn.MultiLabelSoftMarginLoss)
"""Torch losses of (output, target) that compare the two position by position: the shapes must be equal."""

_RESHAPED = (RuntimeError, ValueError, TypeError, IndexError)  # what a loss given the wrong shapes raises


class TargetShapeError(ValueError):
    """An elementwise loss given an output and a target of different shapes (raised inside the stage)."""


class LossShapeError(PipelineError, ValueError):
    """The pipeline's `TargetShapeError`, with the stage, action and micro-batch the loop added: a configuration
    mistake (`ValueError`) found while the pipeline ran (`PipelineError`)."""


def checked(loss_fn: Callable) -> Callable:
    """`loss_fn(output, target)`, with the shapes checked (module docstring)."""

    def loss(output: Any, target: Any) -> Any:
        shapes = _shapes(output, target)
        if shapes is not None and isinstance(loss_fn, ELEMENTWISE) and shapes[0] != shapes[1]:
            raise TargetShapeError(_mismatch(loss_fn, *shapes))
        try:
            return loss_fn(output, target)
        except _RESHAPED as error:
            if shapes is None or type(error) not in _RESHAPED:
                raise
            raise type(error)(f"the loss failed on the output of shape {shapes[0]} and the target of shape "
                              f"{shapes[1]}: {type(error).__name__}: {error}") from error

    loss.loss_fn = loss_fn  # the loss it wraps
    return loss


def _shapes(output: Any, target: Any) -> tuple[tuple, tuple] | None:
    if isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
        return tuple(output.shape), tuple(target.shape)
    return None


def _mismatch(loss_fn: nn.Module, output: tuple, target: tuple) -> str:
    name = f"nn.{type(loss_fn).__name__}"
    text = (f"{name} compares the output with the target value by value, but the output has shape {output} and the "
            f"target shape {target}")
    try:
        broadcast = tuple(torch.broadcast_shapes(output, target))
    except RuntimeError:
        return text + "; give targets of the output's shape"
    return (text + f": it would broadcast both to {broadcast} and give a wrong loss (PyTorch only warns); give "
            "targets of the output's shape, or wrap the loss in a function to broadcast on purpose "
            "(loss_fn=lambda output, target: loss(output, target) is not checked)")


@contextlib.contextmanager
def usage_errors():
    """Inside: a stage's `TargetShapeError`, which the loop made a `PipelineError`, leaves as a `LossShapeError`
    (the same message, the loop's context included), which `except ValueError` catches too."""
    try:
        yield
    except PipelineError as error:
        if isinstance(error, LossShapeError) or not isinstance(error.__cause__, TargetShapeError):
            raise
        raise LossShapeError(*error.args) from error.__cause__
