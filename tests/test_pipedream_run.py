"""Asynchronous PipeDream (`pipelab.pipedream_run.train_async`) against a plain sequential reference.

The reference applies the same stale-weight rule with no pipeline at all: micro-batch i
goes through the whole model at once, stage s using its weights of version
max(0, i - (p - s - 1)) (the closed form of the rule on 1F1B's order, update after every
backward); then every stage's own optimizer takes one step from its latest weights with
that micro-batch's gradient.  Losses and final weights must agree over a whole run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call

import pipelab as pl
from pipelab.pipedream_run import train_async

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sequential_reference(model, n_stages, inputs, targets, loss_fn, make_optimizer):
    stages = pl.split(model, n_stages, "uniform").stages
    names = [[n for n, _ in st.named_parameters()] for st in stages]
    live = [list(st.parameters()) for st in stages]
    optimizers = [make_optimizer(params) for params in live]
    history = [[{n: p.detach().clone() for n, p in zip(names[s], live[s])}] for s in range(n_stages)]
    losses = []
    for i, (x, y) in enumerate(zip(inputs, targets)):
        used = [{n: t.clone().requires_grad_(True) for n, t in history[s][max(0, i - (n_stages - s - 1))].items()}
                for s in range(n_stages)]
        h = x
        for s in range(n_stages):
            h = functional_call(stages[s], used[s], (h,))
        loss = loss_fn(h, y)
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, [w for u in used for w in u.values()])
        k = 0
        for s in range(n_stages):
            for p in live[s]:
                p.grad = grads[k]
                k += 1
            optimizers[s].step()
            optimizers[s].zero_grad(set_to_none=True)
            history[s].append({n: p.detach().clone() for n, p in zip(names[s], live[s])})
    return losses


@pytest.mark.parametrize("n_stages, n_minibatches", [(1, 5), (2, 6), (3, 9), (4, 12)])
def test_async_pipedream_equals_the_sequential_stale_weight_reference(n_stages, n_minibatches):
    model = pl.models.mlp(depth=8, width=16, seed=3)
    ref_model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(5, 16, generator=generator) for _ in range(n_minibatches)]
    targets = [torch.randn(5, 16, generator=generator) for _ in range(n_minibatches)]
    make = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731 (stateful: momentum)
    losses = train_async(model, n_stages, inputs, targets, torch.nn.MSELoss(), make)
    want = sequential_reference(ref_model, n_stages, inputs, targets, torch.nn.MSELoss(), make)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_stale_weights_differ_from_synchronous_training():
    """The rule matters: with p > 1 the run is not plain SGD over the minibatches in order."""
    model, plain = pl.models.mlp(depth=4, width=8, seed=0), pl.models.mlp(depth=4, width=8, seed=0)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    ys = [x.flip(1) for x in xs]
    train_async(model, 2, xs, ys, torch.nn.MSELoss(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in zip(xs, ys):
        sgd.zero_grad()
        torch.nn.MSELoss()(plain(x), y).backward()
        sgd.step()
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), plain.parameters())) > 1e-4


def test_minibatches_of_different_sizes_are_refused():
    """The engine cuts the joined batch into equal micro-batches, so unequal minibatches would be re-split."""
    model = pl.models.mlp(depth=2, width=4, seed=0)
    xs, ys = [torch.randn(4, 4), torch.randn(3, 4)], [torch.randn(4, 4), torch.randn(3, 4)]
    with pytest.raises(ValueError, match="same number of samples"):
        train_async(model, 2, xs, ys, torch.nn.MSELoss(), lambda ps: torch.optim.SGD(ps, lr=0.1))
