"""Train with asynchronous PipeDream (`pl.schedules.pipedream_async`) in one process, stashing weights.

`train_async(model, n_stages, inputs, targets, loss_fn, make_optimizer)` runs one training
run: micro-batch i is PipeDream's minibatch i (its own mean loss, its own update), and each
stage follows the weight-stashing rule of `pl.pipedream` (PipeDream, SOSP 2019, §3.3).  It is
one step of the local engine, `pl.Pipeline(model, n_stages=p, n_microbatches=m,
schedule=pipedream_async(p, m, k), loss_fn=loss_fn, optimizer=make_optimizer)`, whose workers
keep the versions (`runtime/weight_stash.py`): the minibatches are joined into one batch that
the engine cuts back into the same m micro-batches.

Details (the rule, the order the actions run in): docs/course.md, "Lesson 10: synchronous
and asynchronous".
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..model import microbatch
from ..runtime.local import Pipeline
from ..schedules import pipedream_async


def train_async(model: torch.nn.Module, n_stages: int, inputs: list[Any], targets: list[Any], loss_fn: Callable,
                make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                update_every: int = 1) -> list[float]:
    """Run len(inputs) minibatches through asynchronous PipeDream; return each one's loss.

    `model`'s parameters are trained in place; `make_optimizer(params)` builds one
    optimizer per stage (PipeDream's stages update independently).  Every minibatch must
    hold the same number of samples (the engine splits the joined batch evenly).
    """
    if len(inputs) != len(targets) or not inputs:
        raise ValueError(f"give as many input as target minibatches, and at least one; got {len(inputs)} and "
                         f"{len(targets)}")
    sizes = [microbatch.batch_size(x) for x in inputs]
    if len(set(sizes)) > 1:
        raise ValueError(f"every minibatch must hold the same number of samples, got sizes {sizes}")
    m = len(inputs)
    pipe = Pipeline(model, n_stages=n_stages, n_microbatches=m, schedule=pipedream_async(n_stages, m, update_every),
                    loss_fn=loss_fn, devices="cpu",
                    threads=None, optimizer=make_optimizer)
    return pipe.step(microbatch.merge(inputs), microbatch.merge(targets)).microbatch_losses
