"""BatchNorm under micro-batching, and stages that start in place.

A model with BatchNorm in train mode cannot equal the plain step on the whole batch (each
micro-batch is normalised with its own statistics); what the engine must do is the documented
per-micro-batch semantics exactly: the loss and gradients of m micro-batch forwards, and m
updates of the running statistics, no more (its warm-up and a recomputation leave them alone).
The reference below runs those m forwards by hand on a copy of the model.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.model import batch_norm
from pipelab.model.batch_norm import BatchNormWarning

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def model_with_batch_norm(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.GELU(), nn.Linear(16, 4))


def per_microbatch_reference(model, x, y, m):
    """The documented semantics, by hand: micro-batch i's forward (its own statistics, one running update),
    its loss weighted n_i / N; gradients summed."""
    model = copy.deepcopy(model)
    loss_fn, total = nn.MSELoss(), len(x)
    loss = 0.0
    for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
        part = loss_fn(model(xs), ys) * (len(xs) / total)
        part.backward()
        loss += part.item()
    return loss, {n: p.grad for n, p in model.named_parameters()}, {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_train_mode_follows_the_per_microbatch_semantics_and_updates_the_statistics_once_per_microbatch(
        schedule, checkpoint):
    model = model_with_batch_norm()
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    loss, grads, buffers = per_microbatch_reference(model, x, y, 3)
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=3, schedule=schedule, loss_fn=nn.MSELoss(), devices="cpu",
                       checkpoint=checkpoint)  # warm-up on: it must not count as an update
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormWarning)
        result = pipe.step(x, y)
    assert result.loss == pytest.approx(loss, rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6)
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[name], rtol=1e-6, atol=1e-7, msg=name)
    assert int(model[1].num_batches_tracked) == 3  # one update per micro-batch: none from the warm-up or a recomputation


def test_eval_mode_equals_the_plain_step():
    model = model_with_batch_norm().eval()
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    _, reference = pl.single_device_gradients(model, x, y, nn.MSELoss())
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchNormWarning)  # no warning in eval mode
        pl.Pipeline(model, n_stages=3, n_microbatches=3, schedule="1f1b", loss_fn=nn.MSELoss(),
                    devices="cpu").step(x, y)
    assert pl.max_gradient_difference(model, reference) < 1e-6


def test_the_warning_names_the_layer_once_per_model_and_says_what_to_do(monkeypatch):
    monkeypatch.setattr(batch_norm, "_warned", type(batch_norm._warned)())
    model = model_with_batch_norm()
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=3, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cpu")
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    with pytest.warns(BatchNormWarning, match=r"^1 \(BatchNorm1d\) is in train mode: with 3 micro-batches .*eval\(\)"):
        pipe.step(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchNormWarning)
        pipe.step(x, y)  # once per model
        pl.Pipeline(model_with_batch_norm(), n_stages=3, n_microbatches=1, schedule="1f1b", loss_fn=nn.MSELoss(),
                    devices="cpu").step(x, y)  # m = 1: the plain step's statistics


def test_costs_from_profile_and_split_by_time_leave_the_statistics_alone():
    model = model_with_batch_norm()
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    before = {n: b.clone() for n, b in model.named_buffers()}
    parts = pl.split(model, 3, "time", sample=x, repeats=2)
    pl.Costs.from_profile(model, parts, (x[:4], y[:4]), nn.MSELoss(), repeats=2)
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name


def in_place_model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True),
                         nn.Linear(16, 4))


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_stage_that_starts_with_an_in_place_relu_runs_and_is_exact(checkpoint):
    """Stage 1 starts with ReLU(inplace=True) on the activation it receives (a leaf that requires grad)."""
    model = in_place_model()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    _, reference = pl.single_device_gradients(model, x, y, nn.MSELoss())
    partition = pl.Partition([(0, 1), (1, 5)], [model[0:1], model[1:5]], "by hand", [1.0] * 5)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cpu",
                       split_method=partition, checkpoint=checkpoint)
    pipe.step(x, y)
    assert pl.max_gradient_difference(model, reference) < 1e-6
    assert pl.split(model, 2, "time", sample=x, repeats=1).bounds  # the timing runs each block alone too


def test_a_stage_that_returns_a_model_output_is_told_which_field_to_return():
    class Output(dict):
        logits = property(lambda self: self["logits"])

    class Head(nn.Module):
        def forward(self, x):
            return Output(logits=x)

    pipe = pl.Pipeline(nn.Sequential(nn.Linear(4, 4), Head(), nn.Linear(4, 4)), n_stages=3, n_microbatches=1,
                       loss_fn=nn.MSELoss(), devices="cpu", split_method="uniform")
    with pytest.raises(pl.PipelineError, match=r"stage 2 received a Output, not a tensor: have the previous stage "
                                              r"return its \.logits"):
        pipe.step(torch.randn(2, 4), torch.randn(2, 4))
