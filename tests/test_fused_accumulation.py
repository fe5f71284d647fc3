"""Weight gradients accumulated inside the multiply (`runtime/fused_accumulation.py`), against plain autograd.

The reference is PyTorch's own accumulation: the same micro-batches backpropagated one after the other
with no mode active (each weight gradient computed, then added into `.grad` by `AccumulateGrad`).
"""

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.runtime.fused_accumulation import FusedAccumulation


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _accumulate(model, chunks, fused: bool, loss=lambda y: y.square().mean()):
    model.zero_grad(set_to_none=True)
    for chunk in chunks:
        if fused:
            with FusedAccumulation(list(model.parameters())):
                out = model(chunk)
        else:
            out = model(chunk)
        loss(out).backward()
    return _grads(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_gradients_as_autograd_over_micro_batches(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4, bias=False), nn.Tanh(), nn.Linear(4, 3)).to(dtype)
    x = torch.randn(3, 7, 6, dtype=dtype)  # three dimensions: rows of several leading dimensions
    chunks = list(x.chunk(3))
    reference = _accumulate(model, chunks, fused=False)
    fused = _accumulate(model, chunks, fused=True)
    assert reference.keys() == fused.keys()
    for name in reference:
        torch.testing.assert_close(fused[name], reference[name], rtol=1e-5, atol=1e-6)


def test_fused_weights_have_no_accumulate_grad_node_and_inputs_still_get_gradients():
    torch.manual_seed(1)
    layer = nn.Linear(4, 2)
    x = torch.randn(5, 4, requires_grad=True)
    with FusedAccumulation(list(layer.parameters())):
        out = layer(x)
    assert "LinearAccumulatingWeightGrad" in type(out.grad_fn).__name__
    out.sum().backward()
    reference_x = torch.ones(5, 2) @ layer.weight
    torch.testing.assert_close(x.grad, reference_x)
    torch.testing.assert_close(layer.weight.grad, torch.ones(5, 2).t() @ x.detach())
    torch.testing.assert_close(layer.bias.grad, torch.full((2,), 5.0))


def test_left_to_autograd_outside_the_stage_without_grad_or_with_hooks():
    torch.manual_seed(2)
    inside, outside = nn.Linear(3, 3), nn.Linear(3, 3)
    hooked = nn.Linear(3, 3)
    seen = []
    hooked.weight.register_hook(lambda g: seen.append(g.shape))  # a tensor hook must still run
    with FusedAccumulation(list(inside.parameters()) + list(hooked.parameters())):
        a, b, c = inside(torch.randn(2, 3)), outside(torch.randn(2, 3)), hooked(torch.randn(2, 3))
        with torch.no_grad():
            d = inside(torch.randn(2, 3))
    assert "LinearAccumulatingWeightGrad" in type(a.grad_fn).__name__
    assert type(b.grad_fn).__name__ == "AddmmBackward0"  # not one of the given parameters
    assert type(c.grad_fn).__name__ == "AddmmBackward0"  # its weight has a hook
    assert d.grad_fn is None
    (a.sum() + b.sum() + c.sum()).backward()
    assert seen == [torch.Size([3, 3])]


def test_tied_weight_used_twice_sums_both_uses():
    torch.manual_seed(3)
    emb = nn.Embedding(7, 4)
    tokens = torch.tensor([[1, 2, 3], [3, 4, 6]])

    def run(fused):
        emb.zero_grad(set_to_none=True)
        for row in tokens:
            context = FusedAccumulation([emb.weight]) if fused else torch.enable_grad()
            with context:
                logits = torch.nn.functional.linear(emb(row), emb.weight)  # an output layer tied to the embedding
            logits.logsumexp(-1).sum().backward()
        return emb.weight.grad.clone()

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "never"), ("1f1b", "always"), ("zb-h1", "never")])
def test_pipeline_equals_the_single_device_step_with_and_without_fusion(schedule, checkpoint, monkeypatch):
    from pipelab.runtime import fused_accumulation

    calls = []
    apply = fused_accumulation._LinearAccumulatingWeightGrad.apply
    monkeypatch.setattr(fused_accumulation._LinearAccumulatingWeightGrad, "apply",
                        lambda *args: calls.append(1) or apply(*args))
    loss_fn = nn.MSELoss()
    model = pl.models.mlp(depth=4, width=16, seed=0)
    x, y = pl.models.sample_batch(model, 10, seed=1)
    loss_fn(model(x), y).backward()
    reference = _grads(model)
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        pipe = pl.Pipeline(model, 2, 4, schedule, loss_fn, devices="cpu", checkpoint=checkpoint,
                           fused_accumulation=fused)
        calls.clear()
        pipe.step(x, y)
        # 4 Linears x 4 micro-batches (checkpointed: in the recomputation; the first forward builds no graph);
        # none with a split backward (zero bubble), whose B must leave the weight gradients to W
        expected = 0 if not fused or schedule == "zb-h1" else 16
        assert len(calls) == expected
        grads = _grads(model)
        assert grads.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-6)
