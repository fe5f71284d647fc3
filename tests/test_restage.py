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
