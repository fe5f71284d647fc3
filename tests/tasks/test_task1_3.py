"""Task 1.3: one stage's forward and backward for one micro-batch.

The reference is plain autograd on one device: ``loss_fn(model(x), y).backward()`` on the
whole batch.  A pipeline made of the learner's stage_forward / stage_backward, run over
micro-batches with each loss weighted by B_k / B, must give the same loss and the same
gradient for every parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

# Hypothesis's explain phase costs seconds per failing property, more than it tells here.
PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)

pytestmark = pytest.mark.task1_3

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def mlp_in_three_stages(seed: int = 0) -> tuple[nn.Sequential, list[nn.Module]]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )
    return model, [model[0:2], model[2:4], model[4:5]]


def token_model_in_two_stages() -> tuple[nn.Sequential, list[nn.Module]]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Flatten(), nn.Linear(6 * 3, 4))
    return model, [model[0:1], model[1:3]]


def pipelined_step(learner, stages, x, y, loss_fn, n_microbatches, order):
    """One training step through the learner's stages, as a pipeline runs it.

    order="gpipe": every micro-batch's forward, then every backward (GPipe);
    order="one_by_one": forward then backward of micro-batch 0, then 1, ... .
    Returns the batch loss: sum_k (B_k / B) * loss_k.
    """
    batch_size = len(x)
    pending, total_loss = [], 0.0

    def backward(saved):  # saved: [(input_leaf, output)] per stage, output of last = loss
        grad = None
        for input_leaf, output in reversed(saved):
            grad = learner.stage_backward(input_leaf, output, grad)

    for x_mb, y_mb in zip(x.tensor_split(n_microbatches), y.tensor_split(n_microbatches)):
        saved, activation = [], x_mb
        for stage in stages:
            input_leaf, activation = learner.stage_forward(stage, activation)
            saved.append((input_leaf, activation))
        loss = loss_fn(activation, y_mb) * (len(x_mb) / batch_size)
        saved[-1] = (saved[-1][0], loss)
        total_loss += loss.detach()
        if order == "gpipe":
            pending.append(saved)
        else:
            backward(saved)
    for saved in pending:
        backward(saved)
    return total_loss


def assert_same_as_one_device(learner, make_model, x, y, loss_fn, n_microbatches, order):
    model, stages = make_model()
    reference = copy.deepcopy(model)
    expected_loss = loss_fn(reference(x), y)
    expected_loss.backward()

    loss = pipelined_step(learner, stages, x, y, loss_fn, n_microbatches, order)
    where = f"batch of {len(x)} in {n_microbatches} micro-batches, order {order}"
    torch.testing.assert_close(loss, expected_loss.detach(), **TOLERANCE, msg=f"loss ({where})")
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None, (
            f"parameter {name} has no .grad after the pipelined backward ({where}): did "
            f"the backward reach it, and is it accumulated into .grad?"
        )
        torch.testing.assert_close(
            param.grad, expected.grad, **TOLERANCE,
            msg=lambda m, name=name: f"gradient of {name} differs from one device ({where}):\n{m}",
        )


def test_forward_returns_a_fresh_leaf_and_the_stage_output(impl):
    previous, stage = nn.Linear(3, 5), nn.Linear(5, 2)
    received = previous(torch.randn(4, 3))  # carries the previous stage's graph
    input_leaf, output = impl("stage").stage_forward(stage, received)
    assert input_leaf.is_leaf and input_leaf.requires_grad, (
        "stage_forward should return the received activation as a leaf that requires "
        "grad: received.detach().requires_grad_()"
    )
    torch.testing.assert_close(input_leaf, received.detach())
    torch.testing.assert_close(output, stage(received.detach()))


def test_backward_stays_inside_the_stage(impl):
    learner = impl("stage")
    previous, stage = nn.Linear(3, 5), nn.Linear(5, 2)
    input_leaf, output = learner.stage_forward(stage, previous(torch.randn(4, 3)))
    learner.stage_backward(input_leaf, output, torch.ones(4, 2))
    assert previous.weight.grad is None, (
        "the backward of one stage reached the previous stage's parameters: detach the "
        "received activation in stage_forward (the previous stage runs its own backward)"
    )
    assert stage.weight.grad is not None, "stage_backward left the stage's own .grad empty"


def test_backward_returns_the_gradient_for_the_previous_stage(impl):
    learner = impl("stage")
    torch.manual_seed(0)
    stage, received, grad_output = nn.Linear(5, 2), torch.randn(4, 5), torch.randn(4, 2)
    leaf = received.clone().requires_grad_()
    (expected,) = torch.autograd.grad(stage(leaf), leaf, grad_output)

    input_leaf, output = learner.stage_forward(stage, received)
    grad_input = learner.stage_backward(input_leaf, output, grad_output)
    assert grad_input is not None, "stage_backward should return input_leaf.grad, got None"
    torch.testing.assert_close(grad_input, expected, **TOLERANCE)


def test_gradients_accumulate_across_microbatches(impl):
    learner = impl("stage")
    torch.manual_seed(0)
    stage, received, grad_output = nn.Linear(5, 2), torch.randn(4, 5), torch.randn(4, 2)
    stage(received).backward(grad_output)
    one_microbatch = stage.weight.grad.clone()

    stage.weight.grad = torch.ones_like(one_microbatch)  # as if from earlier micro-batches
    input_leaf, output = learner.stage_forward(stage, received)
    learner.stage_backward(input_leaf, output, grad_output)
    torch.testing.assert_close(
        stage.weight.grad, 1 + one_microbatch, **TOLERANCE,
        msg="the stage's .grad must be added to (gradient accumulation), not replaced",
    )


def test_last_stage_backward_starts_from_the_loss(impl):
    learner = impl("stage")
    torch.manual_seed(0)
    stage, received = nn.Linear(5, 1), torch.randn(4, 5)
    input_leaf, output = learner.stage_forward(stage, received)
    grad_input = learner.stage_backward(input_leaf, output.square().mean(), None)

    leaf = received.clone().requires_grad_()
    (expected,) = torch.autograd.grad(stage(leaf).square().mean(), leaf)
    torch.testing.assert_close(grad_input, expected, **TOLERANCE)


def test_token_ids_are_used_as_they_are(impl):
    learner = impl("stage")
    model, (embedding_stage, _) = token_model_in_two_stages()
    token_ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    input_leaf, output = learner.stage_forward(embedding_stage, token_ids)
    assert torch.equal(input_leaf, token_ids) and not input_leaf.requires_grad, (
        "integer token ids have no gradient: stage_forward should use them as they are"
    )
    grad_input = learner.stage_backward(input_leaf, output, torch.ones_like(output))
    assert grad_input is None, "stage_backward should return None when the input has no grad"
    assert model[0].weight.grad is not None


@pytest.mark.parametrize("order", ["gpipe", "one_by_one"])
def test_pipelined_gradients_equal_one_device(impl, order):
    torch.manual_seed(2)
    x, y = torch.randn(10, 4), torch.randn(10, 3)
    assert_same_as_one_device(
        impl("stage"), mlp_in_three_stages, x, y, nn.functional.mse_loss, 4, order
    )


def test_pipelined_language_model_equals_one_device(impl):
    torch.manual_seed(3)
    token_ids, labels = torch.randint(0, 10, (7, 3)), torch.randint(0, 4, (7,))
    assert_same_as_one_device(
        impl("stage"), token_model_in_two_stages, token_ids, labels,
        nn.functional.cross_entropy, 3, "gpipe",
    )


@settings(max_examples=20, deadline=None, phases=PHASES)
@given(st.integers(1, 9).flatmap(lambda b: st.tuples(st.just(b), st.integers(1, b))))
def test_any_number_of_microbatches_gives_one_device_gradients(impl, sizes):
    batch_size, n_microbatches = sizes
    torch.manual_seed(batch_size)
    x, y = torch.randn(batch_size, 4), torch.randn(batch_size, 3)
    assert_same_as_one_device(
        impl("stage"), mlp_in_three_stages, x, y, nn.functional.mse_loss, n_microbatches, "gpipe"
    )
