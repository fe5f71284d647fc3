"""Depth that changes between steps: `Pipeline.restage(p')` on the same model and optimizer continues training
exactly as uninterrupted single-device training (same data, same optimizer state); a model split by names is traced
again at new split points, or cut by its split method."""

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
    with pytest.raises(ValueError, match="restage[(]n[)] re-cuts it by its split_method"):
        pipe.restage(4, schedule="gpipe", devices="cpu", split_points=["2"])  # no sample to trace
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


def test_a_model_split_by_names_restages_at_new_points_or_by_its_method_exactly():
    """A tiny GPT-2 cut by names: two steps at 2 stages, a restage to 3 (no points: its 4 blocks cut evenly), one
    to 2 at other points; every step's loss and the parameters at the end are the single device's."""
    pytest.importorskip("transformers")
    import copy

    from your_model_cases import make_batch, make_model

    model = make_model("gpt2")
    reference = copy.deepcopy(model)
    batches = [make_batch("gpt2", padded=True, seed=k) for k in range(4)]
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=3, split_points=["transformer.h.2"], sample=batches[0],
                       devices="cpu")
    # SGD with momentum: its state goes on across restages, and the parameters move linearly in the gradients
    # (Adam's first steps scale each by its own size, turning rounding in a near-zero gradient into 1e-5)
    sgd, plain = (torch.optim.SGD(params, lr=0.1, momentum=0.9)
                  for params in (pipe.parameters(), reference.parameters()))
    depths = [(2, None, ["transformer.h.2"]), (3, None, ["transformer.h.2", "transformer.h.3"]),
              (2, ["transformer.h.1"], ["transformer.h.1"]), (2, None, ["transformer.h.1"])]
    for step, (depth, points, firsts) in enumerate(depths):
        if depth != pipe.n_stages or points is not None:
            pipe.restage(depth) if points is None else pipe.restage(depth, split_points=points)
        assert [stage.first_module for stage in pipe.partition.stages[1:]] == firsts, step
        loss = pipe.step(batches[step]).loss
        sgd.step()
        sgd.zero_grad(set_to_none=True)
        expected = reference(**batches[step]).loss
        expected.backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        assert loss == pytest.approx(expected.item(), rel=1e-5), step
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=lambda e: f"{name}: {e}")
