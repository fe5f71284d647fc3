"""PipeDream's weight stashing on one stage, for the shared loop (`loop.StageWorker`).

The rule of `pl.schedules.pipedream_async` (PipeDream, Narayanan et al., SOSP 2019, §3.3), per
stage: after every `update_every`-th B the stage's own optimizer steps the live weights and
the version goes up by one; F(s, i) runs with the live version of the moment and stashes it
(a copy, made once per version and shared by the micro-batches that use it); B(s, i)
differentiates the graph F(s, i) built, so with the stashed version, and its gradients are
moved onto the live weights' `.grad`.  A copy is dropped once no micro-batch in flight uses
it and it is not the live version's: p - s versions on stage s in the steady state.

Details: docs/schedules.md, "Asynchronous PipeDream".
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class WeightStash:
    """One stage's weight versions during an asynchronous run."""

    def __init__(self, module: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 update_every: int = 1):
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.live = [p for _, p in named]
        self.optimizer = make_optimizer(self.live)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer= must build a torch.optim.Optimizer from a stage's parameters, "
                            f"got {type(self.optimizer).__name__}")
        self.update_every = update_every
        self.version, self.backwards = 0, 0
        self.copies: dict[int, dict[str, torch.Tensor]] = {}  # version -> its stashed weights, by name
        self.used_by: dict[int, int] = {}  # micro-batch in flight -> the version its F used
        self.peak_versions = 0  # the most versions held at once (copies, plus the live weights if not copied)

    def for_forward(self, microbatch: int) -> dict[str, torch.Tensor]:
        """The weights F(s, `microbatch`) runs with: the live version's copy (made now if it is not yet)."""
        if self.version not in self.copies:
            self.copies[self.version] = {name: p.detach().clone().requires_grad_(p.requires_grad)
                                         for name, p in zip(self.names, self.live)}
        self.used_by[microbatch] = self.version
        self.peak_versions = max(self.peak_versions, len(self.copies))
        return self.copies[self.version]

    def weights_of(self, microbatch: int) -> dict[str, torch.Tensor]:
        """The stashed weights micro-batch `microbatch`'s F ran with (its B differentiates them)."""
        return self.copies[self.used_by[microbatch]]

    def after_backward(self, microbatch: int) -> None:
        """Move B(s, `microbatch`)'s gradients onto the live weights; every `update_every`-th B, update them."""
        stashed = self.copies[self.used_by.pop(microbatch)]
        for name, p in zip(self.names, self.live):
            grad, stashed[name].grad = stashed[name].grad, None
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        self.backwards += 1
        if self.backwards % self.update_every == 0:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
        needed = set(self.used_by.values()) | {self.version}
        self.copies = {v: weights for v, weights in self.copies.items() if v in needed}
