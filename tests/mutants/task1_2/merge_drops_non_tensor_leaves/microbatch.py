"""Mutant of Task 1.2: merge only knows tensors and loses every other leaf.

merge(split({"x": x, "mode": "train"}, 2)) gives {"x": x, "mode": None}.
"""

from __future__ import annotations

from typing import Any

import torch

from solutions.microbatch import split  # noqa: F401  (split is correct)


def merge(chunks: list) -> Any:
    if len(chunks) == 0:
        raise ValueError("nothing to merge")
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(chunks), dim=0)
    if isinstance(first, dict):
        return {key: merge([chunk[key] for chunk in chunks]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(merge([chunk[i] for chunk in chunks]) for i in range(len(first)))
    return None  # BUG: non-tensor leaves are dropped
