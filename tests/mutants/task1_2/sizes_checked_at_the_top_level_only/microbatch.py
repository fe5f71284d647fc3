"""Mutant of Task 1.2: the batch sizes are compared only among the top-level tensors.

``{"x": torch.zeros(4), "extras": [torch.zeros(3)]}`` is split without complaint (the
nested tensor is cut into uneven parts, so micro-batch rows no longer line up) instead
of raising ValueError; a 0-d tensor inside a container slips through the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from solutions.microbatch import _take_chunk, merge  # noqa: F401  (merge is correct)


def split(batch: Any, n: int) -> list:
    batch_size = _top_level_batch_size(batch)
    if n < 1:
        raise ValueError("n must be at least 1")
    if n > batch_size:
        raise ValueError("a micro-batch would be empty")
    return [_take_chunk(batch, n, k) for k in range(n)]


def _top_level_batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        values = [batch]
    elif isinstance(batch, dict):
        values = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = list(batch)
    else:
        values = []
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    if not tensors:  # BUG: only looks one level down for the size to check
        tensors = _first_nested_tensor(values)
    if not tensors:
        raise ValueError("the batch holds no tensor")
    sizes = {len(tensor) if tensor.dim() else 0 for tensor in tensors}
    if len(sizes) > 1 or 0 in sizes:
        raise ValueError("tensors disagree on the batch size")
    return sizes.pop()


def _first_nested_tensor(values: list) -> list:
    for value in values:
        if isinstance(value, torch.Tensor):
            return [value]
        inner = list(value.values()) if isinstance(value, dict) else value
        if isinstance(inner, (tuple, list)):
            found = _first_nested_tensor(list(inner))
            if found:
                return found
    return []
