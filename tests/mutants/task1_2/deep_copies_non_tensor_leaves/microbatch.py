"""Mutant of Task 1.2: every non-tensor leaf is deep-copied into each micro-batch.

``copy.deepcopy`` gives back the very same object for None, ints and strings, so a
batch of only those cannot tell; a mutable leaf (an ``object()``, a tokenizer, a
config object) arrives as n different copies, none of them the caller's.
"""

from __future__ import annotations

import copy
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
        return torch.tensor_split(batch, n)[k]
    if isinstance(batch, dict):
        return {key: _take(value, n, k) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take(value, n, k) for value in batch)
    return copy.deepcopy(batch)  # BUG: the same object, not a copy
