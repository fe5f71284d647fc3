"""Mutant of Task 1.2: ``torch.chunk`` instead of ``torch.tensor_split``.

torch.chunk uses chunks of ceil(B / n) rows and may return fewer than n of them:
torch.chunk(torch.arange(5), 4) has 3 chunks (2, 2, 1), so split(batch, 4) returns 3.
"""

from __future__ import annotations

from typing import Any

import torch

from solutions.microbatch import _batch_size, merge  # noqa: F401  (merge is correct)


def split(batch: Any, n: int) -> list:
    batch_size = _batch_size(batch)
    if n < 1 or n > batch_size:
        raise ValueError("bad n")
    n_chunks = len(torch.chunk(torch.empty(batch_size), n))  # BUG: may be < n
    return [_take(batch, n, k) for k in range(n_chunks)]


def _take(batch: Any, n: int, k: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.chunk(batch, n)[k]
    if isinstance(batch, dict):
        return {key: _take(value, n, k) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take(value, n, k) for value in batch)
    return batch
