"""BatchNorm and a router's balancing loss under micro-batching: computed per micro-batch, not on the batch.

In train mode a `_BatchNorm` layer normalises with the mean and variance of the samples it
sees, and updates its running statistics once per forward.  A pipelined step runs it on each
micro-batch of n_i samples: m normalisations with m different statistics, and m updates of
the running mean and variance (momentum applied m times), where the plain step has one of
each on the whole batch.  The gradients therefore differ from the plain step's; pipelab
says so once per model instead of staying silent.  The options: eval mode (the running
statistics, the same for every sample), GroupNorm or LayerNorm (per-sample statistics), or
m = 1.  The engine's own extra forwards (the warm-up, a recomputation, a profile) leave the
running statistics as they were (`stage.buffers_kept`).

A mixture of experts' load-balancing loss (Switch Transformer, Fedus et al. 2022, eq. 4: N · Σ_i
f_i · P_i, the fraction of tokens routed to expert i times its mean router probability) is a
product of two means over the tokens it sees: a product of means is not the mean of
per-micro-batch products, so the auxiliary loss, and its gradient, differ from the plain step's
(`warn_if_router_loss`).  The language-model loss itself stays exact.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

_warned: weakref.WeakSet = weakref.WeakSet()
_warned_router: weakref.WeakSet = weakref.WeakSet()


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


class RouterLossWarning(UserWarning):
    """A mixture of experts whose router's auxiliary loss is added to the loss, pipelined over micro-batches."""


def warn_if_router_loss(model: nn.Module, n_microbatches: int) -> str | None:
    """Warn (once per model) when `model` (a Hugging Face mixture of experts) adds its routers' load-balancing
    loss to the loss (`output_router_logits=True`, a coefficient above 0) and m > 1; return the warning."""
    config = getattr(model, "config", None)
    coefficient = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    if n_microbatches <= 1 or model in _warned_router or not getattr(config, "output_router_logits", False) \
            or coefficient <= 0:
        return None
    router = next((name for name, m in model.named_modules() if name.endswith(("gate", "router"))
                   and isinstance(m, nn.Linear)), "the routers")
    _warned_router.add(model)
    text = (f"{type(model).__name__} adds its routers' load-balancing loss ({router}, router_aux_loss_coef="
            f"{coefficient}) to the loss: with {n_microbatches} micro-batches each micro-batch computes it from its "
            "own tokens, and that loss is a product of two means over the tokens (the share routed to each expert "
            "times its mean router probability), so the step is per-micro-batch training for it, not the full "
            "batch's: the auxiliary loss and its gradient differ from the plain step (the language-model loss stays "
            "exact).  To match it: output_router_logits=False, or n_microbatches=1.")
    warnings.warn(text, RouterLossWarning, stacklevel=3)
    return text
