"""Mutant of Task 1.2: split cuts detached tensors ("the micro-batches are just data").

The rows and dtypes are right, but a batch that requires grad (an embedding output, an
input whose gradient you want) is cut off from its graph: no gradient flows back to it.
"""

from __future__ import annotations

from typing import Any

import torch

from solutions.microbatch import _batch_size, merge  # noqa: F401  (merge is correct)


def split(batch: Any, n: int) -> list:
    batch_size = _batch_size(batch)
    if n < 1 or n > batch_size:
        raise ValueError("bad n")
    return [_take(batch, n, k) for k in range(n)]


def _take(batch: Any, n: int, k: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.tensor_split(batch.detach(), n)[k]  # BUG: .detach()
    if isinstance(batch, dict):
        return {key: _take(value, n, k) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take(value, n, k) for value in batch)
    return batch
