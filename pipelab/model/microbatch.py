"""Split a batch into micro-batches and merge them back.

A batch is a tensor or any nesting of tuples, lists and dicts whose tensor leaves share
their first (batch) dimension.  Non-tensor leaves (flags, strings, None) are passed to
every micro-batch unchanged.  A list or tuple that holds no tensor (labels, texts: one value
per sample, most likely) is refused, naming it: split, it would need a guess at what its
length means; passed on, every micro-batch would get all of it.  When the batch size B does not divide by n, the sizes
differ by at most one and the larger chunks come first (as `torch.tensor_split`):
B = 10, n = 4 gives 3, 3, 2, 2.
"""

from __future__ import annotations

from typing import Any

import torch


def _tensor_leaves(batch: Any, path: str = "batch"):
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from _tensor_leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from _tensor_leaves(value, f"{path}[{index}]")


def batch_size(batch: Any) -> int:
    """The shared size of dimension 0 of every tensor in `batch` (ValueError if they disagree)."""
    sizes = {}
    for path, tensor in _tensor_leaves(batch):
        if tensor.dim() == 0:
            raise ValueError(f"{path} is a 0-d tensor: it has no batch dimension to split")
        sizes.setdefault(tensor.shape[0], path)
    if not sizes:
        raise ValueError("the batch holds no tensor: nothing to split into micro-batches")
    if len(sizes) > 1:
        listing = ", ".join(f"{path} has {size}" for size, path in sizes.items())
        raise ValueError(f"tensors in the batch disagree on the batch size (dimension 0): {listing}")
    return next(iter(sizes))


def sizes(total: int, n: int) -> list[int]:
    """Micro-batch sizes for `total` samples in `n` chunks: differ by at most one, larger first."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def split(batch: Any, n: int) -> list[Any]:
    """Cut `batch` into `n` micro-batches along dimension 0 (see the module docstring)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"the number of micro-batches must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"the number of micro-batches must be at least 1, got {n}")
    total = batch_size(batch)
    _refuse_lists_without_tensors(batch)
    if n > total:
        raise ValueError(f"cannot split a batch of {total} samples into {n} micro-batches (at most {total})")
    return [_take(batch, i, n) for i in range(n)]


def _refuse_lists_without_tensors(batch: Any, path: str = "batch") -> None:
    """A TypeError naming the first list or tuple (not a namedtuple: a record, like a dict) that holds no tensor."""
    if isinstance(batch, dict):
        for key, value in batch.items():
            _refuse_lists_without_tensors(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        if not hasattr(batch, "_fields") and next(_tensor_leaves(batch), None) is None:
            kinds = sorted({type(value).__name__ for value in batch})
            held = f" ({', '.join(kinds)})" if kinds else ""
            raise TypeError(f"{path} is a {type(batch).__name__} of {len(batch)} values{held} and holds no tensor: "
                            "micro-batches are cut from tensors (along dimension 0), and each would get the whole "
                            f"{type(batch).__name__}; make it a tensor (torch.tensor(...) of its numbers, text "
                            "tokenized first), or leave it out of the batch")
        for index, value in enumerate(batch):
            _refuse_lists_without_tensors(value, f"{path}[{index}]")


def _take(batch: Any, index: int, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.tensor_split(batch, n)[index]
    if isinstance(batch, dict):
        return type(batch)((key, _take(value, index, n)) for key, value in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(value, index, n) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(value, index, n) for value in batch)
    return batch


def merge(chunks: list[Any]) -> Any:
    """Join micro-batches back into one batch (the inverse of `split`)."""
    if not isinstance(chunks, (list, tuple)) or len(chunks) == 0:
        raise ValueError("merge needs a non-empty list of micro-batches")
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(c, torch.Tensor) for c in chunks):
            raise TypeError("merge: some micro-batches hold a tensor where others do not")
        return torch.cat(list(chunks), dim=0)
    if isinstance(first, dict):
        if any(not isinstance(c, dict) or c.keys() != first.keys() for c in chunks):
            raise ValueError("merge: micro-batches have different dict keys")
        return type(first)((key, merge([c[key] for c in chunks])) for key in first)
    if isinstance(first, (list, tuple)):
        if any(not isinstance(c, (list, tuple)) or len(c) != len(first) for c in chunks):
            raise ValueError("merge: micro-batches have different structures (lengths differ)")
        parts = [merge([c[i] for c in chunks]) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return first


def signature(batch: Any) -> tuple:
    """The shapes and dtypes of a micro-batch's tensors (and the types of its other values)."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, dict):
        return tuple((k, signature(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return tuple(signature(v) for v in batch)
    return (type(batch).__name__,)
