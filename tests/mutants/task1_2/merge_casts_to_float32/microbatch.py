"""Mutant of Task 1.2: merge turns every joined tensor into float32.

``torch.cat(chunks).float()``, written with float32 activations in mind: float64 or
bfloat16 outputs, and integer labels or token ids, come back as float32.  Every test in
float32 passes, and ``torch.equal`` does not look at the dtype.
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
        return torch.cat(list(chunks), dim=0).float()  # BUG: the dtype of the chunks is lost
    if isinstance(first, dict):
        return {key: merge([chunk[key] for chunk in chunks]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(merge([chunk[i] for chunk in chunks]) for i in range(len(first)))
    return first
