"""Asynchronous PipeDream in the shared loop (`pl.Pipeline` with `pipedream_async` and `optimizer=`).

Reference: the plain sequential stale-weight reference of tests/test_pipedream_run.py
(no pipeline: micro-batch i through the whole model at once, stage s with its weights of
version max(0, i - (p - s - 1)) // k, then every k-th micro-batch every stage's optimizer
steps), over a whole run with a stateful optimizer (momentum).  The versions a stage held
at once against `pl.pipedream.versions_in_flight` (p - s in the steady state, k = 1).
"""

from __future__ import annotations

import copy

import pytest
import torch

import pipelab as pl
from test_pipedream_run import sequential_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOLERANCE = dict(rtol=1e-6, atol=1e-7)


def momentum_sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def minibatches(model, n, size=5):
    x, y = pl.models.sample_batch(model, n * size, seed=4)
    return pl.microbatch.split(x, n), pl.microbatch.split(y, n)


def run_engine(model, p, xs, ys, update_every=1, checkpoint="never"):
    schedule = pl.schedules.pipedream_async(p, len(xs), update_every)
    pipe = pl.Pipeline(model, n_stages=p, n_microbatches=len(xs), schedule=schedule,
                       loss_fn=pl.models.default_loss(model), devices="cpu",
                       checkpoint=checkpoint, optimizer=momentum_sgd)
    return pipe, pipe.step(torch.cat(xs), torch.cat(ys))


def make(kind):
    if kind == "mlp":
        return pl.models.mlp(depth=8, width=16, seed=3)
    return pl.models.tiny_gpt(n_layers=4, d_model=16, n_heads=2, vocab_size=32, seq_len=6, seed=3)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("n_stages, n_minibatches, checkpoint", [(1, 5, "never"), (2, 6, "always"),
                                                                 (3, 9, "never"), (4, 12, "except_last")])
def test_engine_equals_the_sequential_stale_weight_reference(kind, n_stages, n_minibatches, checkpoint):
    model = make(kind)
    reference = copy.deepcopy(model)
    xs, ys = minibatches(model, n_minibatches)
    pipe, result = run_engine(model, n_stages, xs, ys, checkpoint=checkpoint)
    want = sequential_reference(reference, n_stages, xs, ys, pl.models.default_loss(model), momentum_sgd)
    torch.testing.assert_close(torch.tensor(result.microbatch_losses), torch.tensor(want), **TOLERANCE)
    assert result.loss == pytest.approx(sum(want) / len(want))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOLERANCE, msg=lambda m: f"{name}: {m}")
    assert all(p.grad is None for p in model.parameters())  # every gradient went into an update
    if n_minibatches >= 2 * n_stages - 1:  # enough for stage 0's steady state
        assert [w.stash.peak_versions for w in pipe.workers.values()] == [n_stages - s for s in range(n_stages)]
    assert [w.stash.peak_versions for w in pipe.workers.values()] == pl.pipedream.versions_in_flight(pipe.schedule)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("n_stages, n_minibatches, update_every", [(3, 9, 2), (3, 9, 3), (4, 10, 3)])
def test_updates_every_k_backwards_equal_the_sequential_stale_weight_reference(kind, n_stages, n_minibatches,
                                                                               update_every):
    model = make(kind)
    reference = copy.deepcopy(model)
    xs, ys = minibatches(model, n_minibatches)
    pipe, result = run_engine(model, n_stages, xs, ys, update_every)
    want = sequential_reference(reference, n_stages, xs, ys, pl.models.default_loss(model), momentum_sgd,
                                update_every)
    torch.testing.assert_close(torch.tensor(result.microbatch_losses), torch.tensor(want), **TOLERANCE)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOLERANCE, msg=lambda m: f"{name}: {m}")
        if n_minibatches % update_every:  # the last backwards' gradients wait for an update
            torch.testing.assert_close(p.grad, q.grad, **TOLERANCE)
        else:
            assert p.grad is None
    assert [w.stash.peak_versions for w in pipe.workers.values()] == pl.pipedream.versions_in_flight(pipe.schedule)


def test_update_every_zero_with_a_pipedream_optimizer_gets_pipedreams_message_not_the_synchronous_one():
    """The count is PipeDream's (updates every k-th backward): its error says so, and what 1 means."""
    model = make("mlp")
    for value, error in ((0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error) as caught:
            pl.Pipeline(model, n_stages=2, n_microbatches=4, loss_fn=torch.nn.MSELoss(), devices="cpu",
                        schedule=pl.schedules.pipedream_async(2, 4, update_every=value), optimizer=momentum_sgd)
        assert str(caught.value) == ("update_every (PipeDream's asynchronous schedule: each stage updates its weights "
                                     "after every update_every-th backward) must be a positive int, 1 for an update "
                                     f"after every backward; got {type(value).__name__} {value!r}")
    with pytest.raises(ValueError, match="update_every"):
        pl.pipedream.weight_versions(pl.schedules.pipedream_async(2, 4), update_every=0)
    # a synchronous schedule given a count and an optimizer: the synchronous message, naming both and PipeDream's way
    synchronous = pl.Schedule(2, 4, pl.schedules.one_f_one_b(2, 4).actions, update_every=2)
    with pytest.raises(ValueError, match=r"^optimizer= \(and its update_every=2\) is for asynchronous schedules "
                                         r"\(pipedream-async\).*pl\.schedules\.pipedream_async\(p, m, update_every=k\)"):
        pl.Pipeline(model, n_stages=2, n_microbatches=4, loss_fn=torch.nn.MSELoss(), devices="cpu",
                    schedule=synchronous, optimizer=momentum_sgd)


def test_the_optimizer_goes_with_asynchronous_schedules_only():
    model = make("mlp")
    with pytest.raises(TypeError, match="pass optimizer="):
        pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule="pipedream-async", loss_fn=torch.nn.MSELoss(),
                    devices="cpu")
    with pytest.raises(ValueError, match="optimizer= is for asynchronous schedules"):
        pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss(), devices="cpu",
                    optimizer=momentum_sgd)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule="pipedream-async", loss_fn=torch.nn.MSELoss(),
                    devices="cpu", optimizer=lambda ps: None)
