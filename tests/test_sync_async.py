"""Synchronous 1F1B beside asynchronous PipeDream (`pipelab.course.sync_async`).

References from outside the code under test: 1F1B's closed-form makespan (m + p - 1)(t_F + t_B)
(PipeDream-2BW §3.2), the docstring's drawing, and plain minibatch training of the whole
model on one device with one optimizer (`loss_fn(model(x), y).backward(); optimizer.step()`).
"""

from __future__ import annotations

import copy

import pytest
import torch

import pipelab as pl
from pipelab import schedules
from pipelab.course.sync_async import flushed_1f1b, train_flushed, update_times

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GRID = [(p, m, k) for p in range(1, 5) for m in range(1, 7) for k in (1, 2, 3)]


def test_docstring_draws_the_table():
    drawn = [line.split("|", 1)[1].split() for line in flushed_1f1b.__doc__.splitlines() if "device " in line]
    assert flushed_1f1b(2, 2, 2).grid() == drawn


@pytest.mark.parametrize("t_f, t_b", [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0)])
def test_flushed_steps_take_n_steps_times_one_1f1b_step(t_f, t_b):
    for p, m, k in GRID:
        sched = schedules.validate(flushed_1f1b(p, m, k))
        assert (sched.n_stages, sched.n_microbatches) == (p, k * m)
        trace = pl.simulate(sched, pl.Costs(forward=t_f, backward=t_b))
        assert trace.makespan == pytest.approx(k * (m + p - 1) * (t_f + t_b)), (p, m, k)
        assert trace.peak_inflight == [min(p - s, m) for s in range(p)]  # the flush empties the pipe


def test_update_times_follow_the_closed_forms():
    t_f, t_b = 1.0, 2.0
    for p, m, k in GRID:
        flushed = pl.simulate(flushed_1f1b(p, m, k), pl.Costs(t_f, t_b))
        assert update_times(flushed, m) == pytest.approx([(j + 1) * (m + p - 1) * (t_f + t_b) for j in range(k)])
        n = k * m
        run = pl.simulate(schedules.pipedream_async(p, n), pl.Costs(t_f, t_b))
        assert update_times(run) == pytest.approx([(p + i) * (t_f + t_b) for i in range(n)]), (p, n)


def test_update_times_explain_bad_input():
    trace = pl.simulate(flushed_1f1b(2, 3, 1), pl.Costs(1.0, 2.0))
    with pytest.raises(ValueError, match="do not make whole updates of 2"):
        update_times(trace, 2)
    with pytest.raises(ValueError, match="microbatches_per_update must be at least 1"):
        update_times(trace, 0)


@pytest.mark.parametrize("n_stages, n_microbatches", [(1, 1), (2, 3), (4, 4)])
def test_train_flushed_is_plain_minibatch_training(n_stages, n_microbatches):
    model = pl.models.mlp(depth=4, width=8, seed=2)
    plain = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(11, 8, generator=generator) for _ in range(6)]  # 11 samples: uneven micro-batches
    ys = [torch.tanh(x.flip(1)) for x in xs]
    make = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731 (stateful)
    losses = train_flushed(model, n_stages, n_microbatches, xs, ys, torch.nn.MSELoss(), make)
    optimizer, want = make(list(plain.parameters())), []
    for x, y in zip(xs, ys):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.MSELoss()(plain(x), y)
        loss.backward()
        optimizer.step()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), pl.models.mlp(4, 8, 2).parameters())) > 1e-3


def test_train_flushed_needs_matching_minibatches():
    with pytest.raises(ValueError, match="as many input as target"):
        train_flushed(pl.models.mlp(2, 4), 2, 1, [torch.zeros(2, 4)], [], torch.nn.MSELoss(), torch.optim.SGD)
