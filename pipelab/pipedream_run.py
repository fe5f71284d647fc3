"""Train with asynchronous PipeDream (`pl.schedules.pipedream_async`) in one process, stashing weights.

`train_async(model, n_stages, inputs, targets, loss_fn, make_optimizer)` runs one training
run: micro-batch i is PipeDream's minibatch i (its own mean loss, its own update), the
actions run in the order a unit-time run of the schedule starts them, and each stage
follows the rule of `pl.pipedream` exactly:

- F(s, i) runs with stage s's live weights and stashes that version (a copy, made once per
  version and shared by the micro-batches that use it);
- B(s, i) differentiates the graph F(s, i) built, so with the stashed weights;
- after every `update_every`-th B, stage s's own optimizer steps its live weights with the
  gradients of those backwards (summed).

This is a small executor of its own, not the shared loop of `runtime/loop.py`: the engines
keep one set of weights per stage, and teaching them to keep versions is the next step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.func import functional_call

from .partition import split
from .schedules import pipedream_async
from .timing import run_dependencies


def train_async(model: torch.nn.Module, n_stages: int, inputs: list[Any], targets: list[Any], loss_fn: Callable,
                make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                update_every: int = 1) -> list[float]:
    """Run len(inputs) minibatches through asynchronous PipeDream; return each one's loss.

    `model`'s parameters are trained in place; `make_optimizer(params)` builds one
    optimizer per stage (PipeDream's stages update independently).
    """
    if len(inputs) != len(targets) or not inputs:
        raise ValueError(f"give as many input as target minibatches, and at least one; got {len(inputs)} and "
                         f"{len(targets)}")
    schedule = pipedream_async(n_stages, len(inputs), update_every)
    stages = split(model, n_stages, "uniform").stages
    names = [[name for name, _ in stage.named_parameters()] for stage in stages]
    live = [list(stage.parameters()) for stage in stages]
    optimizers = [make_optimizer(params) for params in live]
    version = [0] * n_stages
    stash_of_version: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in range(n_stages)]
    kept: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> (input, output, stashed weights)
    box: dict[tuple[str, int, int], torch.Tensor] = {}  # activations and gradients in flight
    backwards = [0] * n_stages
    losses: dict[int, float] = {}
    for action in run_dependencies(schedule, duration=lambda a: 1.0).time_order():
        s, i, last = action.stage, action.microbatch, action.stage == n_stages - 1
        if action.kind == "F":
            if version[s] not in stash_of_version[s]:
                stash_of_version[s] = {version[s]: {n: p.detach().clone().requires_grad_(True)
                                                    for n, p in zip(names[s], live[s])},
                                       **stash_of_version[s]}
            weights = stash_of_version[s][version[s]]
            inp = inputs[i] if s == 0 else box.pop(("F", s - 1, i)).requires_grad_(True)
            out = functional_call(stages[s], weights, (inp,))
            if last:
                out = loss_fn(out, targets[i])
                losses[i] = out.item()
            else:
                box[("F", s, i)] = out.detach()
            kept[(s, i)] = (inp, out, weights)
        else:
            inp, out, weights = kept.pop((s, i))
            grad_out = None if last else box.pop(("B", s + 1, i))
            wrt = ([inp] if s > 0 else []) + [weights[n] for n in names[s]]
            grads = torch.autograd.grad(out, wrt, grad_out)
            if s > 0:
                box[("B", s, i)] = grads[0]
            for p, g in zip(live[s], grads[-len(live[s]):]):
                p.grad = g.clone() if p.grad is None else p.grad + g
            backwards[s] += 1
            if backwards[s] % update_every == 0:
                optimizers[s].step()
                optimizers[s].zero_grad(set_to_none=True)
                version[s] += 1
            still_used = {id(w) for _, _, w in kept.values()}
            stash_of_version[s] = {v: w for v, w in stash_of_version[s].items()
                                   if id(w) in still_used or v == version[s]}
    return [losses[i] for i in range(len(inputs))]
