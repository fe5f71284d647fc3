"""Asynchronous PipeDream (`pipelab.course.pipedream_run.train_async`) against a plain sequential reference.

The reference applies the same stale-weight rule with no pipeline at all: micro-batch i
goes through the whole model at once, stage s using its weights of version
max(0, i - (p - s - 1)) // k (the closed form of the rule on 1F1B's order, an update after
every k-th backward: the max(0, i - w) backwards before F(s, i) in stage s's list, w = p - s - 1
warm-up forwards; tests/test_schedules_beyond.py checks it against `weight_versions`); the
micro-batch's gradient is added to every stage's `.grad`, and after every k-th micro-batch
each stage's own optimizer takes one step from its latest weights.  Losses and final
weights must agree over a whole run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call

import pipelab as pl
from pipelab.course.pipedream_run import train_async

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sequential_reference(model, n_stages, inputs, targets, loss_fn, make_optimizer, update_every=1):
    stages = pl.split(model, n_stages, "uniform").stages
    names = [[n for n, _ in st.named_parameters()] for st in stages]
    live = [list(st.parameters()) for st in stages]
    optimizers = [make_optimizer(params) for params in live]
    history = [[{n: p.detach().clone() for n, p in zip(names[s], live[s])}] for s in range(n_stages)]
    losses = []
    for i, (x, y) in enumerate(zip(inputs, targets)):
        used = [{n: t.clone().requires_grad_(True)
                 for n, t in history[s][max(0, i - (n_stages - s - 1)) // update_every].items()}
                for s in range(n_stages)]
        h = x
        for s in range(n_stages):
            h = functional_call(stages[s], used[s], (h,))
        loss = loss_fn(h, y)
        losses.append(loss.item())
        grads = iter(torch.autograd.grad(loss, [w for u in used for w in u.values()]))
        for s in range(n_stages):
            for p in live[s]:
                g = next(grads)
                p.grad = g if p.grad is None else p.grad + g
            if (i + 1) % update_every == 0:
                optimizers[s].step()
                optimizers[s].zero_grad(set_to_none=True)
                history[s].append({n: p.detach().clone() for n, p in zip(names[s], live[s])})
    return losses


@pytest.mark.parametrize("n_stages, n_minibatches, update_every", [(1, 5, 1), (2, 6, 1), (3, 9, 1), (4, 12, 1),
                                                                  (1, 5, 2), (3, 9, 2), (4, 12, 3), (3, 8, 3)])
def test_async_pipedream_equals_the_sequential_stale_weight_reference(n_stages, n_minibatches, update_every):
    model = pl.models.mlp(depth=8, width=16, seed=3)
    ref_model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(5, 16, generator=generator) for _ in range(n_minibatches)]
    targets = [torch.randn(5, 16, generator=generator) for _ in range(n_minibatches)]
    make = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731 (stateful: momentum)
    losses = train_async(model, n_stages, inputs, targets, torch.nn.MSELoss(), make, update_every)
    want = sequential_reference(ref_model, n_stages, inputs, targets, torch.nn.MSELoss(), make, update_every)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
        assert (p.grad is None) == (q.grad is None) == (n_minibatches % update_every == 0)  # left for an update
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


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
