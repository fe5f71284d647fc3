"""What the ranks run in tests/test_pp_fsdp.py (functions given to pl.distributed.launch)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pipelab as pl
from pipelab.predict.layout import Layout
from pipelab.runtime.hybrid import local_shard

BATCH = 19  # prime: the replicas' shares and the micro-batches are uneven
LAYOUT = Layout(dp=2, pp=2)
LR = 1e-2
MAX_NORM = 0.05  # below every case's gradient norm: clipping scales the gradients
GPT2_CUT = ["transformer.h.1"]
GPT2_ROWS = 20  # micro-batches of 5 rows with m = 2: all of the sample's shape, traced once (tracing is slow)  # a Hugging Face GPT-2 split by names, its tied embedding on both stages


def make_model(kind: str = "mlp"):
    if kind == "mlp":
        return pl.models.mlp(depth=8, width=16, seed=1)
    if kind == "gpt":
        return pl.models.tiny_gpt(n_layers=4, d_model=16, n_heads=4, vocab_size=32, seq_len=6, seed=1)
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=8, vocab_size=32, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout, so the step is exact


def make_batch(kind: str, model):
    """(inputs, targets) of the whole batch: a pipelab model's, or the Hugging Face model's keyword arguments."""
    if kind != "gpt2":
        return pl.models.sample_batch(model, BATCH, seed=2)
    ids = torch.randint(0, 32, (GPT2_ROWS, 8), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids}, None


def adamw(parameters):
    return torch.optim.AdamW(parameters, lr=LR, weight_decay=0.1)


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (its shard of a DTensor)."""
    return sum(local_shard(t).numel() * t.element_size() for t in tensors if t is not None)


def _pipeline(kind: str, model, schedule: str, m: int, reshard: bool, batch):
    inputs, _ = batch
    if kind == "gpt2":  # traced on a micro-batch's shape
        sample = {key: value[:GPT2_ROWS // (LAYOUT.dp * m)] for key, value in inputs.items()}
        named = dict(split_points=GPT2_CUT, sample=sample)
    else:
        named = dict(loss_fn=pl.models.default_loss(model))
    return pl.DistributedPipeline(model, n_microbatches=m, schedule=schedule, layout=LAYOUT, shard="fsdp",
                                  reshard_after_forward=reshard, **named)


def run_sharded(cases: list[tuple]) -> dict:
    """On every rank: per case (model kind, schedule, m, reshard_after_forward), two steps on PP2 × FSDP2: of the
    second, the loss, the norm `clip_grad_norm_` clipped, the clipped gradients (gathered), the communication
    counter's records, then one AdamW step: the parameters after it (gathered) and the bytes this rank holds of
    parameters, gradients and optimizer state; and the error a bad shard= gives."""
    found = {"pipelab": pl.__file__, "cases": []}
    for kind, schedule, m, reshard in cases:
        model = make_model(kind)
        batch = make_batch(kind, model)
        pipe = _pipeline(kind, model, schedule, m, reshard, batch)
        optimizer = adamw(pipe.parameters())
        pipe.step(*batch)  # the first step also sends the shape headers
        optimizer.zero_grad(set_to_none=True)
        with pipe.count_communication() as counter:
            result = pipe.step(*batch)
        norm = pipe.clip_grad_norm_(MAX_NORM)
        grads = pipe.gradients()
        optimizer.step()
        after = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()
                 if p.device.type != "meta"}
        parameters = pipe.parameters()
        states = [v for state in optimizer.state.values() for key, v in state.items()
                  if key != "step" and isinstance(v, torch.Tensor)]
        found["cases"].append({"loss": result.loss, "norm": norm, "grads": grads, "after": after,
                               "coordinates": (pipe.dp_index, pipe.pp_index, pipe.tp_index),
                               "parameter_bytes": pipe.parameter_bytes(),
                               "held": {"parameters": _local_bytes(parameters),
                                        "gradients": _local_bytes(p.grad for p in parameters),
                                        "optimizer": _local_bytes(states)},
                               "records": [(r.kind, r.bytes, r.microbatch) for r in counter.records],
                               "gathers_per_microbatch": counter.per_microbatch("fsdp_gather")})
    try:  # a limit below what a rank holds: the refusal counts the shards, the gathered blocks, the whole gradient
        model = make_model()
        pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule="1f1b", loss_fn=pl.models.default_loss(model),
                                      layout=LAYOUT, shard="fsdp", memory_limit_bytes=10_000)
        pipe.step(*make_batch("mlp", model))
    except pl.MemoryBudgetError as error:
        found["over_limit"] = str(error)
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
