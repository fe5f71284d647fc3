"""What the ranks run in tests/test_hybrid.py (functions given to pl.distributed.launch)."""

from __future__ import annotations

import torch

import pipelab as pl
from pipelab.predict.layout import Layout

BATCH = 19  # prime: the replicas' shares and the micro-batches are uneven


def make_model(kind: str):
    if kind == "mlp":
        return pl.models.mlp(depth=8, width=16, seed=1)
    return pl.models.tiny_gpt(n_layers=4, d_model=16, n_heads=4, vocab_size=32, seq_len=6, seed=1)


def run_layouts(cases: list[tuple], count: bool = False) -> list[dict]:
    """On every rank: per case (model kind, (dp, pp, tp), schedule, m), two steps (gradients of the
    second only), what this rank saw; with `count`, the communication of the second step."""
    found = []
    for kind, shape, schedule, n_microbatches in cases:
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        pipe = pl.DistributedPipeline(model, n_microbatches=n_microbatches, schedule=schedule,
                                      loss_fn=pl.models.default_loss(model),
                                      layout=Layout(*shape))
        pipe.step(x, y)  # the first step also sends the shape headers
        for p in pipe.parameters():
            p.grad = None
        if count:
            with pipe.count_communication() as counter:
                result = pipe.step(x, y)
        else:
            result = pipe.step(x, y)
        found.append({
            "loss": result.loss,
            "grads": pipe.gradients(),
            "coordinates": (pipe.dp_index, pipe.pp_index, pipe.tp_index),
            "parameter_bytes": pipe.parameter_bytes(),
            "counts": counter.totals() if count else None,
            "mesh": id(pipe.mesh),
            "saved": {s: dict(pipe.workers[s].saved_bytes) for s in pipe.stages},  # counted, per micro-batch
        })
    return found


def clipped(cases: list[tuple], max_norm: float) -> list[dict]:
    """On every rank: per case (model kind, (dp, pp, tp)), one step, then `pipe.clip_grad_norm_(max_norm)`:
    the norm it returned and the full gradients after it."""
    found = []
    for kind, shape in cases:
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        pipe = pl.DistributedPipeline(model, n_microbatches=2, schedule="1f1b", loss_fn=pl.models.default_loss(model),
                                      layout=Layout(*shape))
        pipe.step(x, y)
        norm = pipe.clip_grad_norm_(max_norm)
        found.append({"norm": norm, "grads": pipe.gradients()})
    return found


def padded_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """The GPT's batch with padded rows (targets -100) spread unevenly over replicas and micro-batches."""
    x, y = pl.models.sample_batch(make_model("gpt"), BATCH, seed=2)
    y = y.clone()
    y[1, 2:], y[4, 1:], y[12:, 3:] = -100, -100, -100
    return x, y


def tokens_over_replicas(shape: tuple) -> dict:
    """On every rank: one step with loss_normalization="tokens" on the padded batch."""
    model = make_model("gpt")
    x, y = padded_tokens()
    pipe = pl.DistributedPipeline(model, n_microbatches=2, schedule="1f1b", loss_fn=pl.models.lm_loss,
                                  loss_normalization="tokens", layout=Layout(*shape))
    result = pipe.step(x, y)
    return {"loss": result.loss, "grads": pipe.gradients()}


def run_sharded(cases: list[tuple], max_norm: float) -> list[dict]:
    """On every rank: per case (model kind, schedule, m, reshard_after_forward), PP2 × TP2 × FSDP2 (shard="fsdp"
    over the tensor-parallel shards): two steps, then `clip_grad_norm_(max_norm)`; the norm, the loss and the
    full clipped gradients of the second."""
    found = []
    for kind, schedule, m, reshard in cases:
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        pipe = pl.DistributedPipeline(model, n_microbatches=m, schedule=schedule, loss_fn=pl.models.default_loss(model),
                                      layout=Layout(2, 2, 2), shard="fsdp", reshard_after_forward=reshard)
        pipe.step(x, y)
        for p in pipe.parameters():
            p.grad = None
        result = pipe.step(x, y)
        norm = pipe.clip_grad_norm_(max_norm)
        found.append({"loss": result.loss, "norm": norm, "grads": pipe.gradients(),
                      "parameter_bytes": pipe.parameter_bytes()})
    return found


def eight_ranks(grid: list[tuple], sharded: list[tuple], max_norm: float) -> dict:
    """One launch of 8 ranks for both: `run_layouts(grid, count=True)` and `run_sharded(sharded, max_norm)`."""
    return {"layouts": run_layouts(grid, True), "sharded": run_sharded(sharded, max_norm)}
