"""What the ranks run in tests/test_distributed_beyond.py: the schedules beyond 1F1B on the distributed engine."""

from __future__ import annotations

import torch

import pipelab as pl
from distributed_cases import BATCH, make_model


def momentum_sgd(params):
    """Each stage's own optimizer in the asynchronous (PipeDream) cases: stateful, so every update counts."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def run_cases(cases: list[tuple]) -> list[dict]:
    """On every rank: one step per case (model kind, schedule, checkpoint); what this rank saw.  An
    asynchronous schedule is one PipeDream run (each micro-batch a minibatch, `momentum_sgd` per stage)."""
    found = []
    for kind, schedule, checkpoint in cases:
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        asynchronous = schedule.asynchronous
        pipe = pl.DistributedPipeline(model, n_microbatches=schedule.n_microbatches, schedule=schedule,
                                      loss_fn=pl.models.default_loss(model),
                                      checkpoint=checkpoint, optimizer=momentum_sgd if asynchronous else None)
        result = pipe.step(x, y)
        found.append({
            "loss": result.loss,
            "losses": result.microbatch_losses,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "weights": {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"},
            "stages": pipe.stages,
            "trace": result.trace,
        })
    return found
