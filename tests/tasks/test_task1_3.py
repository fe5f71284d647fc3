"""Task 1.3: one stage's forward and backward for one micro-batch.

The reference is plain autograd on one device: ``loss_fn(model(x), y).backward()`` on the
whole batch.  A pipeline made of the learner's stage_forward / stage_backward, run over
micro-batches with each loss weighted by B_k / B, must give the same loss and the same
gradient for every parameter, in float32 and float64.  Each call is also checked against
its docstring's promises: the input leaf is a new tensor of the received dtype (float64 and
bfloat16 too), the caller's tensor is left as it was even when it is a leaf, and the
return types are right.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

pytestmark = pytest.mark.task1_3

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}

FRESH_LEAF = "stage_forward returns the received activation as a new leaf that requires grad"
OWN_GRAPH = "the backward of one stage stops at its own input (the received activation is detached)"
ACCUMULATE = "stage_backward adds the parameter gradients to .grad (gradient accumulation)"
GRAD_INPUT = "stage_backward returns dLoss/d input_leaf, the gradient for the previous stage"
DTYPE = "a floating-point activation keeps its dtype (no cast)"
UNCHANGED = "received itself is left unchanged, its requires_grad and .grad as they were"
TOKENS = "integer token ids are used as they are, and stage_backward then returns None"
ONE_DEVICE = "the pipelined step gives the loss and the gradients of one device"


def mlp_in_three_stages(seed: int = 0, dtype=torch.float32) -> tuple[nn.Sequential, list[nn.Module]]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).to(dtype)
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
            requires_grad = activation.requires_grad
            received, (input_leaf, activation) = activation, learner.stage_forward(stage, activation)
            assert received.requires_grad == requires_grad, (
                f"{UNCHANGED}\nthe activation given to stage_forward now has requires_grad="
                f"{received.requires_grad}"
            )
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
    """``x`` may require grad (then every micro-batch is a non-leaf view of it): the
    pipeline's stages must not send a gradient into it, as stage 0 detaches its input."""
    model, stages = make_model()
    reference = copy.deepcopy(model)
    expected_loss = loss_fn(reference(x.detach()), y)
    expected_loss.backward()

    loss = pipelined_step(learner, stages, x, y, loss_fn, n_microbatches, order)
    where = f"{x.dtype} batch of {len(x)} in {n_microbatches} micro-batches, order {order}"
    torch.testing.assert_close(loss, expected_loss.detach(), **TOLERANCE,
                               msg=lambda m: f"{ONE_DEVICE}\nthe loss differs ({where}):\n{m}")
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None, (
            f"{ONE_DEVICE}\nparameter {name} has no .grad after the pipelined backward ({where}): "
            f"did the backward reach it, and is it accumulated into .grad?"
        )
        torch.testing.assert_close(
            param.grad, expected.grad, **TOLERANCE,
            msg=lambda m, name=name: f"{ONE_DEVICE}\nthe gradient of {name} differs ({where}):\n{m}",
        )
    assert x.grad is None, f"{OWN_GRAPH}\nthe batch itself got a .grad ({where})"


def test_forward_returns_a_fresh_leaf_and_the_stage_output(impl):
    previous, stage = nn.Linear(3, 5), nn.Linear(5, 2)
    received = previous(torch.randn(4, 3))  # carries the previous stage's graph
    input_leaf, output = impl("stage").stage_forward(stage, received)
    assert isinstance(input_leaf, torch.Tensor) and input_leaf.is_leaf and input_leaf.requires_grad, (
        f"{FRESH_LEAF}\ngot a tensor with is_leaf={input_leaf.is_leaf}, requires_grad="
        f"{input_leaf.requires_grad}: received.detach().requires_grad_()"
    )
    torch.testing.assert_close(input_leaf, received.detach())
    torch.testing.assert_close(output, stage(received.detach()))


def test_backward_stays_inside_the_stage(impl):
    learner = impl("stage")
    previous, stage = nn.Linear(3, 5), nn.Linear(5, 2)
    input_leaf, output = learner.stage_forward(stage, previous(torch.randn(4, 3)))
    learner.stage_backward(input_leaf, output, torch.ones(4, 2))
    assert previous.weight.grad is None, (
        f"{OWN_GRAPH}\nthe backward of one stage reached the previous stage's parameters: "
        "detach the received activation in stage_forward (the previous stage runs its own backward)"
    )
    assert stage.weight.grad is not None, f"{ACCUMULATE}\nstage_backward left the stage's own .grad empty"


def test_backward_returns_the_gradient_for_the_previous_stage(impl):
    learner = impl("stage")
    torch.manual_seed(0)
    stage, received, grad_output = nn.Linear(5, 2), torch.randn(4, 5), torch.randn(4, 2)
    leaf = received.clone().requires_grad_()
    (expected,) = torch.autograd.grad(stage(leaf), leaf, grad_output)

    input_leaf, output = learner.stage_forward(stage, received)
    grad_input = learner.stage_backward(input_leaf, output, grad_output)
    assert grad_input is not None, f"{GRAD_INPUT}\nstage_backward returned None"
    torch.testing.assert_close(grad_input, expected, **TOLERANCE, msg=lambda m: f"{GRAD_INPUT}\n{m}")


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
        msg=lambda m: f"{ACCUMULATE}\nthe stage's .grad was replaced, not added to:\n{m}",
    )


def test_last_stage_backward_starts_from_the_loss(impl):
    learner = impl("stage")
    torch.manual_seed(0)
    stage, received = nn.Linear(5, 1), torch.randn(4, 5)
    input_leaf, output = learner.stage_forward(stage, received)
    grad_input = learner.stage_backward(input_leaf, output.square().mean(), None)

    leaf = received.clone().requires_grad_()
    (expected,) = torch.autograd.grad(stage(leaf).square().mean(), leaf)
    torch.testing.assert_close(grad_input, expected, **TOLERANCE,
                               msg=lambda m: f"{GRAD_INPUT} (the last stage's, from the loss)\n{m}")


def test_token_ids_are_used_as_they_are(impl):
    learner = impl("stage")
    model, (embedding_stage, _) = token_model_in_two_stages()
    token_ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    input_leaf, output = learner.stage_forward(embedding_stage, token_ids)
    assert torch.equal(input_leaf, token_ids) and not input_leaf.requires_grad, (
        f"{TOKENS}\nstage_forward returned {input_leaf!r} for the token ids {token_ids!r}"
    )
    grad_input = learner.stage_backward(input_leaf, output, torch.ones_like(output))
    assert grad_input is None, f"{TOKENS}\nstage_backward returned {grad_input!r}"
    assert model[0].weight.grad is not None, f"{ACCUMULATE}\nthe embedding got no gradient"


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_other_floating_dtypes_are_detached_and_kept(impl, dtype):
    learner = impl("stage")
    torch.manual_seed(0)
    previous, stage = nn.Linear(3, 5).to(dtype), nn.Linear(5, 2).to(dtype)
    received = previous(torch.randn(4, 3, dtype=dtype))  # carries the previous stage's graph
    input_leaf, output = learner.stage_forward(stage, received)
    assert input_leaf.dtype == dtype, f"{DTYPE} (got {input_leaf.dtype})\nreceived a {dtype} activation"
    assert input_leaf.is_leaf and input_leaf.requires_grad, (
        f"{FRESH_LEAF}\nfor a {dtype} activation: is_leaf={input_leaf.is_leaf}, "
        f"requires_grad={input_leaf.requires_grad}"
    )
    grad_output = torch.linspace(-1, 1, 8, dtype=dtype).reshape(4, 2)
    grad_input = learner.stage_backward(input_leaf, output, grad_output)
    assert previous.weight.grad is None, f"{OWN_GRAPH}\nthe {dtype} backward reached the previous stage"
    leaf = received.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(stage(leaf), leaf, grad_output)
    assert grad_input is not None and grad_input.dtype == dtype, (
        f"{GRAD_INPUT}, of input_leaf's dtype\ngot {grad_input if grad_input is None else grad_input.dtype}"
    )
    torch.testing.assert_close(grad_input, expected, msg=lambda m: f"{GRAD_INPUT}\n{m}")


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain_leaf", "leaf_that_requires_grad"])
def test_a_received_leaf_is_left_unchanged(impl, requires_grad):
    # The first stage receives the batch itself: a leaf, which the caller owns.
    learner = impl("stage")
    torch.manual_seed(0)
    stage, received = nn.Linear(5, 2), torch.randn(4, 5, requires_grad=requires_grad)
    before = received.clone().detach()
    result = learner.stage_forward(stage, received)
    assert type(result) is tuple and len(result) == 2, (
        f"stage_forward returns (input_leaf, output), a tuple\ngot {type(result).__name__}"
    )
    input_leaf, output = result
    assert input_leaf is not received, (
        f"{FRESH_LEAF}\nstage_forward returned the caller's own tensor as input_leaf "
        "(it is a leaf already, but not this stage's to change): detach it"
    )
    assert received.requires_grad == requires_grad, (
        f"{UNCHANGED}\nreceived.requires_grad became {received.requires_grad}"
    )
    grad_input = learner.stage_backward(input_leaf, output, torch.ones(4, 2))
    assert received.grad is None, f"{UNCHANGED}\nthe caller's tensor got a .grad: {received.grad}"
    assert torch.equal(received.detach(), before), f"{UNCHANGED}\nits values changed"
    leaf = before.clone().requires_grad_()
    (expected,) = torch.autograd.grad(stage(leaf), leaf, torch.ones(4, 2))
    assert isinstance(grad_input, torch.Tensor), f"{GRAD_INPUT}\ngot {grad_input!r}"
    torch.testing.assert_close(grad_input, expected, **TOLERANCE, msg=lambda m: f"{GRAD_INPUT}\n{m}")


@st.composite
def steps(draw):
    batch_size = draw(st.integers(1, 9))
    return (batch_size, draw(st.integers(1, batch_size)), draw(st.sampled_from([torch.float32, torch.float64])),
            draw(st.sampled_from(["gpipe", "one_by_one"])), draw(st.booleans()))


@settings(max_examples=20, deadline=None)
@example((1, 1, torch.float32, "gpipe", False))  # m = 1
@example((8, 3, torch.float64, "one_by_one", True))  # a remainder of 2, float64, a batch that requires grad
@example((5, 5, torch.float32, "one_by_one", False))  # one sample per micro-batch
@given(steps())
def test_any_number_of_microbatches_gives_one_device_gradients(impl, case):
    batch_size, n_microbatches, dtype, order, batch_requires_grad = case
    torch.manual_seed(batch_size)
    x = torch.randn(batch_size, 4, dtype=dtype).requires_grad_(batch_requires_grad)
    y = torch.randn(batch_size, 3, dtype=dtype)
    assert_same_as_one_device(
        impl("stage"), lambda: mlp_in_three_stages(dtype=dtype), x, y, nn.functional.mse_loss,
        n_microbatches, order,
    )
