"""What the ranks run in tests/test_pp_fsdp.py (functions given to pl.distributed.launch)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import pipelab as pl
from pipelab.predict.layout import Layout

BATCH = 19  # prime: the replicas' shares and the micro-batches are uneven
LAYOUT = Layout(dp=2, pp=2)
LR = 1e-2


def make_model(kind: str = "mlp"):
    if kind == "mlp":
        return pl.models.mlp(depth=8, width=16, seed=1)
    return pl.models.tiny_gpt(n_layers=4, d_model=16, n_heads=4, vocab_size=32, seq_len=6, seed=1)


def adamw(parameters):
    return torch.optim.AdamW(parameters, lr=LR, weight_decay=0.1)


def run_sharded(cases: list[tuple]) -> dict:
    """On every rank: per case (model kind, schedule, m, reshard_after_forward), two steps on PP2 × FSDP2 (the gradients of the
    second, gathered, then one AdamW step: the parameters after it, gathered) and, with the communication
    counter on, that second step's records; and the error a bad shard= gives."""
    found = {"pipelab": pl.__file__, "cases": []}
    for kind, schedule, m, reshard in cases:
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        pipe = pl.DistributedPipeline(model, n_microbatches=m, schedule=schedule, loss_fn=pl.models.default_loss(model),
                                      layout=LAYOUT, shard="fsdp", reshard_after_forward=reshard)
        optimizer = adamw(pipe.parameters())
        pipe.step(x, y)  # the first step also sends the shape headers
        optimizer.zero_grad(set_to_none=True)
        with pipe.count_communication() as counter:
            result = pipe.step(x, y)
        grads = pipe.gradients()
        optimizer.step()
        after = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()
                 if p.device.type != "meta"}
        found["cases"].append({"loss": result.loss, "grads": grads, "after": after,
                               "coordinates": (pipe.dp_index, pipe.pp_index, pipe.tp_index),
                               "parameter_bytes": pipe.parameter_bytes(),
                               "records": [(r.kind, r.op, r.bytes) for r in counter.records]})
    try:
        pl.DistributedPipeline(make_model(), n_microbatches=2, loss_fn=torch.nn.MSELoss(), layout=LAYOUT,
                               shard="zero4")
    except ValueError as error:
        found["bad_shard"] = str(error)
    try:  # rank 0 alone shards: every rank says so, before any sharding
        pl.DistributedPipeline(make_model(), n_microbatches=2, loss_fn=torch.nn.MSELoss(), layout=LAYOUT,
                               shard="fsdp" if dist.get_rank() == 0 else None)
    except ValueError as error:
        found["disagreeing"] = str(error)
    return found
