"""The single device's training run: `pl.train`'s loop without a pipeline, the reference every pipelined run is
checked against (lessons 12 and 13, scripts/train_corpus.py).

    run = pl.train(pipe, batches, optimizer, epochs=2, clip=1.0)                  # pipelined
    one = one_device.train(copy_of_model, batches, copy_optimizer, epochs=2, clip=1.0, loss_fn=loss_fn)
    assert one_device.relative_gap(run.losses, one.losses) < 1e-5

The same loop as runtime/training_run.py: each epoch seeded with `torch.manual_seed(seed + epoch)` before the
loader is iterated, so a shuffled `DataLoader` gives both the same batches in the same order; then per batch zero
the gradients (the optimizer's), the loss, backward, clip (every parameter with a `.grad`, as
`pipe.clip_grad_norm_` does: clear the old gradients of parameters you freeze, `model.zero_grad()`), the
optimizer's and the scheduler's steps.  On one intra-op thread, as the engines time their ops.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..common.threads import intra_op_threads
from ..runtime.training_run import as_step_arguments


@dataclasses.dataclass
class OneDeviceRun:
    """What `train` did: the loss of every step (before its update), its seconds, the input tokens it saw."""

    losses: list[float]
    seconds: float
    tokens: int  # input tokens seen (the batches' elements)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def train(model: nn.Module, batches: Iterable, optimizer: torch.optim.Optimizer, *, epochs: int = 1,
          clip: float | None = None, scheduler: Any = None, seed: int | None = 0, max_steps: int | None = None,
          loss_fn: Callable | None = None, threads: int | None = 1) -> OneDeviceRun:
    """`pl.train`'s loop on `model` itself (module docstring): a batch is a dict (`model(**batch).loss`) or an
    (inputs, targets) pair (`loss_fn(model(inputs), targets)`, MSE by default)."""
    losses, tokens, begin = [], 0, time.perf_counter()
    parameters = list(model.parameters())  # as `pipe.clip_grad_norm_` clips: a frozen one's old .grad counts too
    with intra_op_threads(threads):
        for epoch in range(epochs):
            if seed is not None:
                torch.manual_seed(seed + epoch)
            for batch in batches:
                inputs, targets = as_step_arguments(batch)
                optimizer.zero_grad(set_to_none=True)
                if targets is None:
                    loss = model(**inputs).loss
                else:
                    loss = (loss_fn or nn.MSELoss())(model(inputs), targets)
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(parameters, clip)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                losses.append(float(loss.detach()))
                tokens += _input_tokens(inputs)
                if max_steps is not None and len(losses) >= max_steps:
                    return OneDeviceRun(losses, time.perf_counter() - begin, tokens)
    return OneDeviceRun(losses, time.perf_counter() - begin, tokens)


def evaluate(model: nn.Module, batches: Iterable, loss_fn: Callable, threads: int | None = 1) -> float:
    """The mean loss over `batches` of (inputs, targets), forward only, each batch weighed by its samples (what
    `pl.train`'s held-out evaluation reports for a `loss_fn` that averages over samples)."""
    total, samples = 0.0, 0
    with torch.no_grad(), intra_op_threads(threads):
        for inputs, targets in batches:
            total += float(loss_fn(model(inputs), targets)) * len(inputs)
            samples += len(inputs)
    return total / samples if samples else float("nan")


def _input_tokens(inputs: Any) -> int:
    if isinstance(inputs, dict):
        inputs = inputs.get("input_ids", next(iter(inputs.values())))
    return int(inputs.numel())


def relative_gap(found: Sequence[float], expected: Sequence[float]) -> float:
    """The largest |found − expected| / |expected| over two equally long loss curves (inf if their lengths differ)."""
    if len(found) != len(expected) or not found:
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(found, expected))


__all__ = ["OneDeviceRun", "evaluate", "relative_gap", "train"]
