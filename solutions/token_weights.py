"""Task 6.1: token-normalised loss weights across micro-batches, exact with padding (lesson 12)."""

from __future__ import annotations

import torch


def token_weights(labels: list[torch.Tensor], ignore_index: int = -100, shift: bool = False) -> list[float]:
    """Micro-batch i's loss weight c_i / C, so that the micro-batches' losses add up to the full batch's.

    A language model's loss is a mean over its *counted tokens*: the labels other than
    ``ignore_index`` (padding, and prompt tokens, are labelled -100 and left out), not a
    mean over samples.  ``labels[i]`` is micro-batch i's label tensor (any shape, its first
    dimension the samples); micro-batch i holds c_i counted tokens, and its loss is the mean
    over them, L_i = S_i / c_i (S_i: the sum of their losses).  The full batch's loss is
    S / C, with C = c_0 + c_1 + ..., so micro-batch i must count c_i / C:

        sum_i (c_i / C) * L_i = sum_i S_i / C = S / C

    Weighting by samples, n_i / N, is exact only when every micro-batch holds as many
    counted tokens per sample: padded in uneven amounts, it is not.

    ``shift=True`` is a causal language model's loss: position t predicts token t + 1, so
    the first label of each sequence is never a target and only ``labels[i][..., 1:]`` is
    counted (Hugging Face's ``ForCausalLMLoss`` shifts the labels so).  ``shift=False``
    counts every label (a token classifier, a masked language model).

    Returns a list of Python ``float``, one per micro-batch, each c_i / C to double
    precision (not the rounding of a float32 tensor); they sum to 1.  ``labels``, a list
    or a tuple, and its tensors are left unchanged.

    >>> import torch
    >>> token_weights([torch.tensor([[5, 6, -100]]), torch.tensor([[7, 8, 9]])])  # 2 and 3 tokens
    [0.4, 0.6]
    >>> token_weights([torch.tensor([[5, 6, -100]]), torch.tensor([[7, 8, 9]])], shift=True)  # 1 and 2
    [0.3333333333333333, 0.6666666666666666]

    Raises:
        ValueError: if a micro-batch has no counted token (its mean loss would be 0/0, and
            every gradient NaN); the message names the first such one as "micro-batch i".
            Also if there is no counted token at all (no micro-batch).
    """
    counts = []
    for micro_labels in labels:
        counted = micro_labels[..., 1:] if shift else micro_labels
        counts.append(int((counted != ignore_index).sum()))
    for i, count in enumerate(counts):
        if count == 0:
            raise ValueError(
                f"micro-batch {i} has no counted token (every label{' after the first' if shift else ''} of it "
                f"is {ignore_index}): its mean loss is 0/0"
            )
    total = sum(counts)
    if total == 0:
        raise ValueError("no micro-batch, so no counted token: the batch's mean loss is 0/0")
    return [count / total for count in counts]
