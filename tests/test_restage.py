"""Depth that changes between steps: `Pipeline.restage(p')` on the same model and optimizer continues training
exactly as uninterrupted single-device training (same data, same optimizer state)."""

import pytest
import torch

import pipelab as pl


def test_training_through_depths_four_two_three_equals_one_device():
    model = pl.models.mlp(depth=8, width=32, seed=0)
    reference = pl.models.mlp(depth=8, width=32, seed=0)
    x, y = pl.models.sample_batch(model, 32)
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss(), devices="cpu")
    adam, plain = torch.optim.Adam(pipe.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step, depth in enumerate([4, 4, 2, 2, 3, 8]):
        if depth != pipe.n_stages:
            pipe.restage(depth)  # between steps: a host left, or came back
        batch = slice(step % 2 * 16, step % 2 * 16 + 16)
        loss = pipe.step(x[batch], y[batch]).loss
        adam.step()
        adam.zero_grad(set_to_none=True)
        expected = torch.nn.MSELoss()(reference(x[batch]), y[batch])
        expected.backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        assert pipe.n_stages == depth and len(pipe.partition) == depth
        assert loss == pytest.approx(float(expected.detach()), rel=1e-5), step
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_restage_says_what_it_needs():
    model = pl.models.mlp(depth=4, width=8)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule=pl.schedules.gpipe(2, 2),
                       loss_fn=torch.nn.MSELoss(), devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="schedule="):
        pipe.restage(4)
    with pytest.raises(ValueError, match="devices="):
        pipe.restage(4, schedule="gpipe")
    pipe.restage(4, schedule="gpipe", devices="cpu")
    assert pipe.schedule.n_stages == 4


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_warm_up_and_a_restage_leave_accumulated_gradients_as_they_were(schedule):
    """Gradients accumulate across steps as with loss.backward(): a pipeline built on a model that already holds
    gradients (its first step warms up first: the warm-up's own gradients must not be added into them), then a
    restage between two steps without zero_grad (a planted bug that re-creates .grad, or a warm-up that adds
    micro-batch 0 into the tensors it restores, makes the sum wrong)."""
    model = pl.models.mlp(depth=8, width=16, seed=3)
    x, y = pl.models.sample_batch(model, 12)
    _, grads = pl.single_device_gradients(model, x, y, torch.nn.MSELoss())
    torch.nn.MSELoss()(model(x), y).backward()  # one plain step's gradients, already there
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=3, schedule=schedule, loss_fn=torch.nn.MSELoss(),
                       devices="cpu", warm_up=True)
    pipe.step(x, y)
    pipe.restage(2)  # warms up again on its first step
    pipe.step(x, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 3 * grads[name], rtol=1e-5, atol=1e-6, msg=name)
