"""B/W split of a stage's backward (`pipelab.model.split_backward`) against one plain backward.

Reference: `torch.autograd.grad` of the same output w.r.t. the input and every weight at
once.  The split must give the same tensors bit for bit, and W must not run the nodes of
the input path (a GELU's, a tanh's, attention's softmax's backward): those ran in B.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.model.split_backward import _graph_of, backward_input, backward_weight


def one_input(output, grad_output, inp, parameters):
    """backward_input for one output and one input: (the input's gradient or None, the work for W)."""
    found, work = backward_input([output], [grad_output], [inp], parameters)
    return (found[0] if found else None), work


def split_run(stage: nn.Module, inp: torch.Tensor, grad_output: torch.Tensor | None):
    """Run stage forward, then B and W; return (input grad, weight grads, node names run in B, in W)."""
    for p in stage.parameters():
        p.grad = None
    output = stage(inp)
    ran = {"B": [], "W": []}
    phase = ["B"]
    hooks = [n.register_hook(lambda gi, go, n=n: ran[phase[0]].append(n.name())) for n in _graph_of([output.grad_fn])]
    grad_input, work = one_input(output, grad_output, inp, list(stage.parameters()))
    phase[0] = "W"
    backward_weight(work)
    for h in hooks:
        h.remove()
    return grad_input, [p.grad for p in stage.parameters()], ran


def plain(stage: nn.Module, inp: torch.Tensor, grad_output: torch.Tensor | None):
    output = stage(inp)
    grad = torch.ones_like(output) if grad_output is None else grad_output
    wrt = ([inp] if inp.requires_grad else []) + list(stage.parameters())
    found = torch.autograd.grad(output, wrt, grad)
    return (found[0] if inp.requires_grad else None), list(found[-len(list(stage.parameters())):])


STAGES = {
    "mlp": lambda: (pl.models.mlp(depth=3, width=8, seed=0), torch.randn(5, 8)),
    "layernorm": lambda: (nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 8)), torch.randn(5, 8)),
    "gpt blocks": lambda: (pl.models.tiny_gpt(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=6)[1:3],
                           torch.randn(3, 6, 16)),
}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_split_gives_the_plain_gradients_bit_for_bit(name):
    torch.manual_seed(0)
    stage, x = STAGES[name]()
    x.requires_grad_(True)
    grad_output = torch.randn_like(stage(x))
    want_input, want_weights = plain(stage, x, grad_output)
    got_input, got_weights, ran = split_run(stage, x.detach().requires_grad_(True), grad_output)
    assert torch.equal(got_input, want_input)
    for got, want in zip(got_weights, want_weights):
        assert torch.equal(got, want)
    input_path_only = {"GeluBackward0", "TanhBackward0", "SoftmaxBackward0", "ReluBackward0"}
    assert ran["W"] and not input_path_only & set(ran["W"]), ran["W"]
    assert not {"TBackward0"} & set(ran["B"]), "B reached a weight's branch"


def test_w_adds_to_existing_gradients():
    stage, x = STAGES["mlp"]()
    grad_output = torch.randn(5, 8)
    _, once, _ = split_run(stage, x.clone().requires_grad_(True), grad_output)
    once = [g.clone() for g in once]
    inp = x.clone().requires_grad_(True)
    _, work = one_input(stage(inp), grad_output, inp, list(stage.parameters()))
    backward_weight(work)  # .grad already holds `once`: W adds, like loss.backward()
    for p, g in zip(stage.parameters(), once):
        assert torch.equal(p.grad, g + g)


def test_first_stage_has_no_input_gradient_and_w_does_the_whole_backward():
    stage, x = STAGES["mlp"]()
    grad_output = torch.randn(5, 8)
    _, want = plain(stage, x, grad_output)
    got_input, got, ran = split_run(stage, x, grad_output)
    assert got_input is None and ran["B"] == []
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_last_stage_loss_without_grad_output():
    stage, x = STAGES["mlp"]()
    x.requires_grad_(True)
    ref = torch.autograd.grad(stage(x).pow(2).mean(), [x] + list(stage.parameters()))
    x2 = x.detach().requires_grad_(True)
    got_input, work = one_input(stage(x2).pow(2).mean(), None, x2, list(stage.parameters()))
    backward_weight(work)
    assert torch.equal(got_input, ref[0])
    for p, r in zip(stage.parameters(), ref[1:]):
        assert torch.equal(p.grad, r)


class TwoWay(nn.Module):
    """Two inputs in, two outputs out, the weights mixed across them (a stage passing a structure on)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        h = torch.tanh(self.a(x)) + self.b(y)
        return self.c(h), h * y


def test_several_inputs_and_outputs_give_the_plain_gradients():
    torch.manual_seed(0)
    stage, x, y = TwoWay(), torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    outputs = stage(x, y)
    grads = [torch.randn_like(o) for o in outputs]
    want = torch.autograd.grad(outputs, [x, y, *stage.parameters()], grads)
    x2, y2 = x.detach().requires_grad_(True), y.detach().requires_grad_(True)
    found, work = backward_input(list(stage(x2, y2)), grads, [x2, y2], list(stage.parameters()))
    assert all(p.grad is None for p in stage.parameters())  # I touched no weight
    backward_weight(work)
    assert torch.equal(found[0], want[0]) and torch.equal(found[1], want[1])
    for p, w in zip(stage.parameters(), want[2:]):
        assert torch.allclose(p.grad, w, rtol=1e-6, atol=1e-7)


def test_one_output_and_one_input_give_one_gradient_tensor():
    """The plain form lesson 11 calls: backward_input(output, grad, input, weights) -> (a tensor, work)."""
    stage = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    h = torch.randn(3, 4, requires_grad=True)
    grad_out = torch.randn(3, 4)
    weights = list(stage.parameters())
    plain = torch.autograd.grad(stage(h), [h, *weights], grad_out)
    grad_input, work = pl.split_backward.backward_input(stage(h), grad_out, h, weights)
    assert isinstance(grad_input, torch.Tensor) and torch.equal(grad_input, plain[0])
    pl.split_backward.backward_weight(work)
    assert all(torch.equal(w.grad, g) for w, g in zip(weights, plain[1:]))


class Twice(nn.Module):
    """One Linear applied twice (a weight-tied recurrence): its weight hangs off the input path at two nodes."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return self.linear(torch.tanh(self.linear(x)))


def test_a_linear_applied_twice_in_one_stage_gets_its_gradient_once_under_zero_bubble():
    """W must add each weight's gradient once, though two boundary nodes reach it (their groups are merged).

    Planted bugs it catches (each fails only this test): in `split_backward.backward_input`, keeping the groups a
    new boundary node overlaps instead of replacing them by the merged one (`groups = groups + [merged]`): the
    shared weight is then in two groups, and W adds its gradient twice; in `backward_weight`, dropping the
    pre-hooks that give a boundary node below another exactly what I recorded there (`if len(members) > 1` made
    never true): the lower node then also gets what flows down from the upper one, counted twice.  The suite's
    other stages use each weight once, so their groups never merge."""
    torch.manual_seed(0)
    stage, x = Twice(), torch.randn(5, 8)
    grad_output = torch.randn(5, 8)
    want_input, want_weights = plain(stage, x.clone().requires_grad_(True), grad_output)
    got_input, got_weights, _ = split_run(stage, x.clone().requires_grad_(True), grad_output)
    torch.testing.assert_close(got_input, want_input, rtol=0, atol=0)
    for got, want in zip(got_weights, want_weights):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # and through the engine: ZB-H1 (I then W on every stage) against the single device
    model = nn.Sequential(nn.Linear(8, 8), Twice(), Twice(), nn.Linear(8, 8))
    inputs, targets = torch.randn(12, 8), torch.randn(12, 8)
    _, reference = pl.single_device_gradients(model, inputs, targets, nn.MSELoss())
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule="zb-h1", loss_fn=nn.MSELoss(), devices="cpu")
    pipe.step(inputs, targets)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=1e-5, atol=1e-6, msg=lambda e: f"{name}: {e}")
