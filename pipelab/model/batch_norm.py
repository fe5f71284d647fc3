"""BatchNorm under micro-batching: its statistics come from each micro-batch, not from the batch.

In train mode a `_BatchNorm` layer normalises with the mean and variance of the samples it
sees, and updates its running statistics once per forward.  A pipelined step runs it on each
micro-batch of n_i samples: m normalisations with m different statistics, and m updates of
the running mean and variance (momentum applied m times), where the plain step has one of
each on the whole batch.  The gradients therefore differ from the plain step's; pipelab
says so once per model instead of staying silent.  The options: eval mode (the running
statistics, the same for every sample), GroupNorm or LayerNorm (per-sample statistics), or
m = 1.  The engine's own extra forwards (the warm-up, a recomputation, a profile) leave the
running statistics as they were (`stage.buffers_kept`).
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

_warned: weakref.WeakSet = weakref.WeakSet()


class BatchNormWarning(UserWarning):
    """A model with BatchNorm in train mode, pipelined over several micro-batches."""


def warn_if_batch_norm(model: nn.Module, n_microbatches: int) -> str | None:
    """Warn (once per model) when `model` has a `_BatchNorm` layer in train mode and m > 1; return the warning."""
    if n_microbatches <= 1 or model in _warned:
        return None
    found = next((name for name, m in model.named_modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training), None)
    if found is None:
        return None
    _warned.add(model)
    text = (f"{found or 'the model'} ({type(model.get_submodule(found)).__name__}) is in train mode: with "
            f"{n_microbatches} micro-batches it normalises each micro-batch with that micro-batch's own mean and "
            "variance and updates its running statistics once per micro-batch, so the loss and gradients differ "
            "from the plain step on the whole batch.  To match it: model.eval() (running statistics), GroupNorm or "
            "LayerNorm instead, or n_microbatches=1.")
    warnings.warn(text, BatchNormWarning, stacklevel=3)
    return text
