"""Weight gradients accumulated inside the multiply (`model/fused_accumulation.py`), against plain autograd.

The reference is PyTorch's own accumulation: the same micro-batches backpropagated one after the other
with nothing swapped in (each weight gradient computed, then added into `.grad` by `AccumulateGrad`).
"""

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.model import fused_accumulation
from pipelab.model.fused_accumulation import FusedAccumulation


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _accumulate(model, chunks, fused: bool):
    model.zero_grad(set_to_none=True)
    fusion = FusedAccumulation(model, list(model.parameters()), min_weight_elements=0)
    for chunk in chunks:
        if fused:
            with fusion:
                out = model(chunk)
        else:
            out = model(chunk)
        out.square().mean().backward()
    return _grads(model)


def _fused(out) -> bool:
    return "LinearAccumulatingWeightGrad" in type(out.grad_fn).__name__


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


def test_input_weight_and_bias_gradients_by_hand_and_the_module_restored():
    torch.manual_seed(1)
    layer = nn.Linear(4, 2)
    x = torch.randn(5, 4, requires_grad=True)
    with FusedAccumulation(layer, list(layer.parameters()), min_weight_elements=0):
        out = layer(x)
    assert _fused(out) and "forward" not in layer.__dict__  # the class's forward is back
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(5, 2) @ layer.weight)
    torch.testing.assert_close(layer.weight.grad, torch.ones(5, 2).t() @ x.detach())
    torch.testing.assert_close(layer.bias.grad, torch.full((2,), 5.0))
    assert type(layer(x).grad_fn).__name__ == "AddmmBackward0"


def test_only_weights_of_the_threshold_size_are_fused():
    small, large = nn.Linear(16, 16), nn.Linear(512, 512)
    fusion = FusedAccumulation(nn.ModuleList([small, large]), list(small.parameters()) + list(large.parameters()))
    assert fusion.linears == [large]


def test_left_to_autograd_outside_the_stage_without_grad_with_hooks_or_an_own_forward():
    torch.manual_seed(2)

    class Scaled(nn.Linear):  # a subclass with its own forward keeps it
        def forward(self, x):
            return 2 * super().forward(x)

    inside, outside, hooked, scaled = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3), Scaled(3, 3)
    stage = nn.ModuleList([inside, hooked, scaled])
    fusion = FusedAccumulation(stage, list(stage.parameters()), min_weight_elements=0)
    seen = []
    hooked.weight.register_hook(lambda g: seen.append(g.shape))  # registered after: it must still run
    with fusion:
        a, b, c, d = (layer(torch.randn(2, 3)) for layer in (inside, outside, hooked, scaled))
        with torch.no_grad():
            e = inside(torch.randn(2, 3))
    assert _fused(a)
    assert type(b.grad_fn).__name__ == "AddmmBackward0"  # not one of the stage's parameters
    assert type(c.grad_fn).__name__ == "AddmmBackward0"  # its weight has a hook
    assert type(d.grad_fn).__name__ == "MulBackward0" and _fused(d) is False
    assert e.grad_fn is None
    (a.sum() + b.sum() + c.sum() + d.sum()).backward()
    assert seen == [torch.Size([3, 3])]


def test_tied_weight_used_by_an_embedding_and_a_fused_linear_sums_both_uses():
    torch.manual_seed(3)
    emb, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = emb.weight  # an output layer tied to the embedding
    model = nn.Sequential(emb, head)
    tokens = torch.tensor([[1, 2, 3], [3, 4, 6]])

    def run(fused):
        model.zero_grad(set_to_none=True)
        fusion = FusedAccumulation(model, list(model.parameters()), min_weight_elements=0)
        for row in tokens:
            with fusion if fused else torch.enable_grad():
                logits = model(row)
            assert _fused(logits) is fused
            logits.logsumexp(-1).sum().backward()
        return emb.weight.grad.clone()

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "never"), ("1f1b", "always"), ("zb-h1", "never")])
def test_pipeline_equals_the_single_device_step_with_and_without_fusion(schedule, checkpoint, monkeypatch):
    calls = []
    apply = fused_accumulation._LinearAccumulatingWeightGrad.apply
    monkeypatch.setattr(fused_accumulation._LinearAccumulatingWeightGrad, "apply",
                        lambda *args: calls.append(1) or apply(*args))
    monkeypatch.setattr(fused_accumulation, "MIN_WEIGHT_ELEMENTS", 0)  # the test's 16 x 16 weights too
    loss_fn = nn.MSELoss()
    model = pl.models.mlp(depth=4, width=16, seed=0)
    x, y = pl.models.sample_batch(model, 10, seed=1)
    loss_fn(model(x), y).backward()
    reference = _grads(model)
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        pipe = pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule=schedule, loss_fn=loss_fn, devices="cpu",
                           checkpoint=checkpoint,
                           fused_accumulation=fused)
        calls.clear()
        pipe.step(x, y)
        # 4 Linears x (4 micro-batches + the warm-up's one, the same per-stage work) (checkpointed: in the
        # recomputation; the first forward builds no graph); none with a split backward (zero bubble), whose
        # I must leave the weight gradients to W
        expected = 0 if not fused or schedule == "zb-h1" else 4 * (4 + 1)
        assert len(calls) == expected
        grads = _grads(model)
        assert grads.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_two_steps_without_zero_grad_add_up_at_the_real_threshold(fused):
    """Two steps without `zero_grad` leave the sum of their gradients, as `loss.backward()` twice does, with
    weights of 512 x 512, where the engines really fuse (not a lowered threshold): a fusion that overwrote
    `.grad` on a step's first backward would keep only the second step's."""
    loss_fn = nn.MSELoss()
    model = pl.models.mlp(depth=2, width=512, seed=0)
    x, y = pl.models.sample_batch(model, 8, seed=1)
    (2 * loss_fn(model(x), y)).backward()  # two identical steps: twice one step's gradient
    reference = _grads(model)
    model.zero_grad(set_to_none=True)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="1f1b", loss_fn=loss_fn, devices="cpu",
                       fused_accumulation=fused)
    fusing = [len(worker.fusion.linears) if worker.fusion else 0 for worker in pipe.workers.values()]
    assert fusing == ([1, 1] if fused else [0, 0])  # one Linear(512, 512) per stage
    pipe.step(x, y)
    pipe.step(x, y)
    grads = _grads(model)
    assert grads.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_gpt2_split_by_names_fuses_its_conv1d_and_lm_head_and_two_steps_add_up(schedule, monkeypatch):
    """A traced model: GPT-2's Conv1D multiplies (`aten.addmm(b, x, W)`) and its LM head (`aten.linear`, the tied
    embedding) accumulate in the multiply.  Two steps without `zero_grad` give twice the single-device step's
    gradients, padded tokens and all; a split backward (zero bubble) fuses none."""
    pytest.importorskip("transformers")
    from your_model_cases import SPLITS, make_batch, make_model, reference_gradients

    calls = {"linear": 0, "addmm": 0}
    for name, function in (("linear", fused_accumulation._LinearAccumulatingWeightGrad),
                           ("addmm", fused_accumulation._AddmmAccumulatingWeightGrad)):
        def counted(*args, _name=name, _apply=function.apply):
            calls[_name] += 1
            return _apply(*args)
        monkeypatch.setattr(function, "apply", counted)
    monkeypatch.setattr(fused_accumulation, "MIN_WEIGHT_ELEMENTS", 0)  # the test's 32-wide weights too
    model, batch = make_model("gpt2"), make_batch("gpt2", padded=True)
    _, reference = reference_gradients(model, batch)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=3, schedule=schedule, split_points=SPLITS["gpt2"][0][:1],
                       sample=batch, loss_normalization="tokens", devices="cpu", warm_up=False)
    routed = [len(stage.routed_weights) for stage in pipe.partition.stages]
    assert routed == [4, 3 * 4 + 1]  # 4 Conv1D a block (1 block, then 3), and the LM head
    pipe.step(batch)
    pipe.step(batch)
    if schedule == "zb-h1":
        assert calls == {"linear": 0, "addmm": 0}
    else:  # 2 steps x 3 micro-batches through each routed multiply: 4 blocks of 4 Conv1D, one LM head
        assert calls == {"linear": 2 * 3, "addmm": 2 * 3 * 4 * 4}
    found = _grads(model)
    assert found.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(found[name], 2 * grad, rtol=1e-5, atol=1e-6, msg=name)
