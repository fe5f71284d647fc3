"""Mutant of Task 1.2: equal chunks of B // n, and the remainder all in the last one.

split(torch.arange(10), 4) gives sizes [2, 2, 2, 4], not [3, 3, 2, 2]: the last
micro-batch can be almost twice the others, and the pipeline waits for it.
"""

from __future__ import annotations

from typing import Any

import torch

from solutions.microbatch import _batch_size, merge  # noqa: F401  (merge is correct)


def split(batch: Any, n: int) -> list:
    batch_size = _batch_size(batch)
    if n < 1 or n > batch_size:
        raise ValueError("bad n")
    size = batch_size // n
    sizes = [size] * (n - 1) + [batch_size - size * (n - 1)]  # BUG: remainder at the end
    return [_take(batch, sizes, k) for k in range(n)]


def _take(batch: Any, sizes: list[int], k: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.split(batch, sizes)[k]
    if isinstance(batch, dict):
        return {key: _take(value, sizes, k) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take(value, sizes, k) for value in batch)
    return batch
