"""NaN and inf, found where they first appear: a stage's output, or the loss.

Both engines take `check_finite=`: "first" (the default) checks the first step, True every
step, False none.  While a step is checked, each stage's forward (`stage.stage_function`) runs
one `isfinite().all()` per floating-point tensor it outputs, and one on the loss of the last
stage, and raises `NonFiniteError` at the first value that is not finite.  It is raised inside
the action, so the loop adds the stage, the action, the micro-batch and the rank (a
`PipelineError`, `runtime/loop.py`); the actions run in dependency order, so the first stage
whose output is reported is the one that made the NaN.  The cost is one reduction, and on a
GPU one synchronisation, per stage output of a checked step.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

_CHECKING = contextvars.ContextVar("pipelab_check_finite", default=False)


class NonFiniteError(FloatingPointError):
    """A stage's output or the loss holds NaN or inf (raised inside the action: the loop adds where)."""


def check_mode(value: Any) -> str | bool:
    """`check_finite=`: "first", True or False."""
    if value is True or value is False or (isinstance(value, str) and value == "first"):
        return value
    raise ValueError(f'check_finite must be "first" (check the first step for NaN and inf, the default), True '
                     f"(every step) or False (never), got {value!r}")


class FiniteChecks:
    """An engine's `check_finite` policy: `with checks.step():` around a step checks it or not."""

    def __init__(self, mode: Any = "first"):
        self.mode = check_mode(mode)
        self.started = False  # a step has begun (the first one is checked, whether it ends well or not)

    @contextlib.contextmanager
    def step(self):
        token = _CHECKING.set(self.mode is True or (self.mode == "first" and not self.started))
        self.started = True
        try:
            yield
        finally:
            _CHECKING.reset(token)


def checking() -> bool:
    """Whether the step running now is checked."""
    return _CHECKING.get()


def _floats(value: Any) -> list[tuple[str, torch.Tensor]]:
    found = []
    for path, leaf in tree_flatten_with_path(value)[0]:
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            local = getattr(leaf, "to_local", None)  # a DTensor: this rank's shard, without communication
            # detached: isfinite decomposes into differentiable ops (abs) that would save the output for a backward
            found.append((keystr(path), (local() if callable(local) else leaf).detach()))
    return found


def _finite(tensors: list[torch.Tensor]) -> bool:
    if not tensors:
        return True
    if len(tensors) == 1:
        return bool(torch.isfinite(tensors[0]).all())
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def _describe(name: str, tensor: torch.Tensor) -> str:
    t = tensor.detach()
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    kinds = " and ".join(f"{count} {label}" for count, label in ((nan, "NaN"), (inf, "inf")) if count)
    first = tuple(int(k) for k in (~torch.isfinite(t)).nonzero()[0]) if t.dim() else ()
    where = f"output{name}" if name else "output"
    at = f", the first at index {first}" if first else ""
    return f"the stage's {where} (shape {tuple(t.shape)}) holds {kinds} of its {t.numel()} values{at}"


def check_output(output: Any, inp: Any) -> None:
    """Raise `NonFiniteError` if a floating-point tensor of the stage's `output` holds NaN or inf, saying whether
    its input `inp` was finite (then they first appear in this stage's blocks)."""
    found = _floats(output)
    if _finite([t for _, t in found]):
        return
    name, tensor = next((name, t) for name, t in found if not _finite([t]))
    if _finite([t for _, t in _floats(inp)]):
        origin = "its input is finite: they first appear in this stage's blocks"
    else:
        origin = "its input already holds NaN or inf (the micro-batch itself, on the first stage)"
    raise NonFiniteError(f"{_describe(name, tensor)}; {origin} (check_finite=False turns this check off)")


def check_loss(loss: torch.Tensor) -> None:
    """Raise `NonFiniteError` if the loss is NaN or inf (the stage's output was checked finite before)."""
    local = [t for _, t in _floats(loss)]
    if not _finite(local):
        raise NonFiniteError(f"the loss is {float(local[0].detach())} though the stage's output is finite: "
                             "loss_fn made it (a log of 0, a division by 0, a target out of range?) "
                             "(check_finite=False turns this check off)")
