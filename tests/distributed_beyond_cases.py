"""What the ranks run in tests/test_distributed_beyond.py: the schedules beyond 1F1B on the distributed engine."""

from __future__ import annotations

import pipelab as pl
from distributed_cases import BATCH, make_model


def run_cases(cases: list[tuple]) -> list[dict]:
    """On every rank: one step per case (model kind, schedule, checkpoint); what this rank saw."""
    found = []
    for kind, schedule, checkpoint in cases:
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        pipe = pl.DistributedPipeline(model, schedule.n_microbatches, schedule, pl.models.default_loss(model),
                                      checkpoint=checkpoint)
        result = pipe.step(x, y)
        found.append({
            "loss": result.loss,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "stages": pipe.stages,
            "trace": result.trace,
        })
    return found
