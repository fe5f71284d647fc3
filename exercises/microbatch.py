"""Task 1.2: split a batch into micro-batches and merge them back (lesson 02)."""

from __future__ import annotations

from typing import Any

import torch


def split(batch: Any, n: int) -> list:
    """Split ``batch`` into ``n`` micro-batches along dimension 0.

    ``batch`` is a tensor or any nesting of tuples, lists and dicts whose leaves are
    tensors or other values.  Every tensor leaf is cut along dim 0 into slices of itself,
    as ``torch.tensor_split`` cuts it: the same dtype (float64, bfloat16, int64, ...) and
    device, and gradients flow back to the leaf.  Every other leaf (an int, a string,
    None, an object of any class, ...) is passed unchanged, the same object, not a copy,
    to every micro-batch.  Returns a list of ``n`` micro-batches, each with the structure
    of ``batch``: the same container types, a dict's keys in the same order.  ``batch``
    itself is left unchanged.

    With B the batch size (dim 0 of every tensor leaf), micro-batch k gets

        B // n + 1  rows if k < B % n,  else  B // n  rows

    so sizes differ by at most one and the larger micro-batches come first, as with
    ``torch.tensor_split``.  (``torch.chunk`` is different: it may return fewer than n.)

    >>> [chunk.tolist() for chunk in split(torch.arange(10), 4)]
    [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    >>> split({"x": torch.tensor([[1], [2]]), "mode": "train"}, 2)
    [{'x': tensor([[1]]), 'mode': 'train'}, {'x': tensor([[2]]), 'mode': 'train'}]

    Raises:
        ValueError: if ``n < 1``; if ``n > B`` (a micro-batch would be empty); if the
            batch holds no tensor; if tensor leaves, at any depth of the nesting,
            disagree on the batch size (a 0-d tensor has none).
    """
    # TODO: Implement for Task 1.2.
    raise NotImplementedError("Task 1.2")


def merge(chunks: list) -> Any:
    """Join micro-batches back into one batch: the inverse of :func:`split`.

    ``chunks`` are structures of the same shape (as returned by ``split``, or the
    outputs of a stage for each micro-batch).  Tensor leaves are joined with
    ``torch.cat(..., dim=0)``, which keeps their dtype and lets gradients flow back to
    each chunk; every other leaf is taken from the first chunk, the same object, so
    ``merge(split(batch, n))`` equals ``batch``.  Where the chunks' non-tensor leaves
    differ (a count or a name per micro-batch), the first chunk's leaf wins: the others
    are neither compared nor gathered into a list.  ``chunks`` are left unchanged.

    >>> merge([torch.tensor([0, 1, 2]), torch.tensor([3, 4])])
    tensor([0, 1, 2, 3, 4])

    Raises:
        ValueError: if ``chunks`` is empty.
    """
    # TODO: Implement for Task 1.2.
    raise NotImplementedError("Task 1.2")
