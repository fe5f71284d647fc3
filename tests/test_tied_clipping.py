"""Clipping on ranks counts a parameter shared by several ranks once: a tied Llama's embedding, held by the first and
the last rank (its gradient all-reduced between them), enters the global norm on the lower rank only, so the norm
is `torch.nn.utils.clip_grad_norm_`'s on one device and clipped AdamW steps leave the same parameters."""

from __future__ import annotations

import pytest
import torch

import pipelab as pl
from your_model_cases import make_batch, make_model, reference_gradients

pytest.importorskip("transformers")

MAX_NORM, STEPS = 0.5, 2


def clipped_adamw_on_ranks() -> dict:
    """On every rank: STEPS steps of the tied Llama cut before its third layer, each clipped to MAX_NORM, then
    AdamW; the norms, and this rank's parameters after."""
    model, batch = make_model("llama"), make_batch("llama", padded=True)
    pipe = pl.DistributedPipeline(model, n_microbatches=3, schedule="1f1b", split_points=["model.layers.2"],
                                  sample=batch, loss_normalization="tokens")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    norms = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        pipe.step(batch)
        norms.append(pipe.clip_grad_norm_(MAX_NORM))
        optimizer.step()
    return {"norms": norms, "shared": pipe.shared.ranks,
            "params": {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}}


@pytest.mark.slow
def test_clipping_a_tied_model_on_two_ranks_counts_the_shared_embedding_once():
    per_rank = pl.distributed.launch(clipped_adamw_on_ranks, 2, timeout_seconds=120)
    model, batch = make_model("llama"), make_batch("llama", padded=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        _, grads = reference_gradients(model, batch)
        for name, param in model.named_parameters():
            param.grad = grads.get(name)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    assert min(norms) > MAX_NORM  # every step is clipped
    embedding = "model.embed_tokens.weight"
    assert per_rank[0]["shared"] == {embedding: [0, 1]}  # the tied embedding: on both ranks
    params = dict(model.named_parameters())
    for rank in per_rank:
        assert rank["norms"] == pytest.approx(norms, rel=1e-5)
        for name, param in rank["params"].items():
            torch.testing.assert_close(param, params[name], rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(per_rank[0]["params"][embedding], per_rank[1]["params"][embedding], rtol=0, atol=0)
