"""Weigh each micro-batch's loss so that the pipelined loss is the model's own full-batch loss.

A language model's loss is a mean over its *counted tokens* (labels other than -100: padding and
prompt tokens are not counted), not over its samples.  Micro-batch i holds c_i counted tokens and
its loss is the mean over them, L_i = S_i / c_i (S_i: the sum of its tokens' losses).  The
full-batch loss is S / C with C = sum_i c_i, so micro-batch i must count c_i / C:

    sum_i (c_i / C) * L_i = sum_i S_i / C = S / C                     (loss_normalization="tokens")

Weighting by samples instead, n_i / N (exact for a per-sample mean such as MSE or a classifier's
cross-entropy), gives sum_i (n_i / N) * S_i / c_i, which differs from S / C as soon as the
micro-batches hold different numbers of counted tokens: padding.  The default, "auto", picks
tokens for the model's own loss (loss_fn=None: Hugging Face's losses average over counted
labels) and for a loss with an `ignore_index` (cross-entropy, NLL), samples otherwise; a batch
whose labels hold -100 weighed by samples gets a warning, once.  Megatron-LM
divides by the global count of tokens (over micro-batches and data-parallel replicas) for this
reason; Hugging Face's `num_items_in_batch` serves the same purpose in gradient accumulation.

A causal language model shifts its labels (position t predicts token t + 1), so only
labels[..., 1:] are counted there (Hugging Face's `ForCausalLMLoss`; its Trainer counts the same).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

NORMALIZATIONS = ("auto", "samples", "tokens")
IGNORE_INDEX = -100  # the label PyTorch's cross_entropy and Hugging Face's losses leave out


def token_weights(counts: list[int]) -> list[float]:
    """Micro-batch i's loss weight c_i / C, from the counted tokens c_i of every micro-batch (module docstring)."""
    total = sum(counts)
    if total == 0:
        raise ValueError("the batch has no counted token (every label is -100): its mean loss is 0/0")
    empty = [i for i, c in enumerate(counts) if c == 0]
    if empty:
        raise ValueError(f"micro-batch {empty[0]} has no counted token (all its labels are -100): its mean loss is "
                         "0/0, which would make every gradient NaN; use fewer micro-batches, or put the padded "
                         "samples among the others")
    return [c / total for c in counts]


def shifts_labels(model: nn.Module) -> bool:
    """Whether `model`'s own loss shifts its labels by one (a Hugging Face causal language model)."""
    loss = getattr(type(model), "loss_function", None)
    try:
        loss = model.loss_function if loss is not None else None
    except (AttributeError, KeyError, ValueError):
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return getattr(loss, "__name__", "") == "ForCausalLMLoss"


def resolved(loss_fn: Callable | None, normalization: str) -> str:
    """"samples" or "tokens": "auto" is tokens for the model's own loss or a loss with an ignore_index."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"loss_normalization is one of {list(NORMALIZATIONS)}, got {normalization!r}")
    if normalization != "auto":
        return normalization
    return "tokens" if loss_fn is None or hasattr(loss_fn, "ignore_index") else "samples"


def ignored_labels(inputs: Any, targets: Any, loss_fn: Callable | None) -> bool:
    """Whether the batch's labels (the targets, or `inputs["labels"]`) hold the ignored label (-100)."""
    labels = labels_of(inputs, targets)
    if labels is None or labels.is_floating_point():
        return False
    return bool((labels == getattr(loss_fn, "ignore_index", IGNORE_INDEX)).any())


def labels_of(inputs: Any, targets: Any) -> torch.Tensor | None:
    """A batch's labels: its targets, or `inputs["labels"]`; None where it has none."""
    if targets is not None:
        return targets
    labels = inputs.get("labels") if isinstance(inputs, dict) else None
    return labels if isinstance(labels, torch.Tensor) else None


def token_counter(model: nn.Module, loss_fn: Callable | None, normalization: str) -> Callable | None:
    """For loss_normalization="tokens" (or "auto" resolved to it): a function (inputs, targets) of one
    micro-batch -> its counted tokens, reading the targets (or, without them, `inputs["labels"]`); None for
    "samples".  Its `required` says whether a batch without labels is an error ("tokens") or weighed by samples
    ("auto": a model that computes its own loss from no labels at all)."""
    if resolved(loss_fn, normalization) == "samples":
        return None
    ignore = getattr(loss_fn, "ignore_index", IGNORE_INDEX)
    shift = loss_fn is None and shifts_labels(model)

    def count(inputs: Any, targets: Any) -> int:
        labels = labels_of(inputs, targets)
        if labels is None:
            raise ValueError('loss_normalization="tokens" counts the labels other than -100: pass targets, or '
                             "a batch dict with 'labels'")
        if shift:
            labels = labels[..., 1:]
        return int((labels != ignore).sum())

    count.required = normalization == "tokens"
    return count


def counter_for(count_tokens: Callable | None, inputs: Any, targets: Any) -> Callable | None:
    """`count_tokens` for this batch, or None (weigh by samples) where "auto" meets a batch without labels."""
    if count_tokens is None or count_tokens.required or labels_of(inputs, targets) is not None:
        return count_tokens
    return None
