"""The pipelined step equals the plain single-device step: same loss, same gradients.

Reference: `loss_fn(model(x), y).backward()` on the whole batch, computed once per model
with plain autograd (no pipelab code on that path).
"""

import pytest
import torch

import pipelab as pl

BATCH = 19  # prime: most m give uneven micro-batches
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(kind):
    if kind == "mlp":
        return pl.models.mlp(depth=8, width=16, seed=1)
    return pl.models.tiny_gpt(n_layers=6, d_model=16, n_heads=2, vocab_size=32, seq_len=6, seed=1)


def reference(model, x, y, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_matches(model, result, ref_loss, ref_grads, where):
    torch.testing.assert_close(torch.tensor(result.loss, dtype=ref_loss.dtype), ref_loss, **TOLERANCE,
                               msg=lambda m: f"{where}: loss differs\n{m}")
    for (name, p), g in zip(model.named_parameters(), ref_grads):
        assert p.grad is not None, f"{where}: {name} got no gradient"
        torch.testing.assert_close(p.grad, g, **TOLERANCE, msg=lambda m: f"{where}: grad of {name}\n{m}")


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n_stages", range(1, 9))
def test_pipeline_equals_single_device_step(kind, schedule, n_stages):
    model = make_model(kind)
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    ref_loss, ref_grads = reference(model, x, y, loss_fn)
    for n_microbatches in range(1, 17):
        model.zero_grad(set_to_none=True)
        pipe = pl.Pipeline(model, n_stages=n_stages, n_microbatches=n_microbatches, schedule=schedule,
                           loss_fn=loss_fn, devices="cpu")
        result = pipe.step(x, y)
        assert_matches(model, result, ref_loss, ref_grads, f"{kind} {schedule} p={n_stages} m={n_microbatches}")
        assert len(result.trace.events) == 2 * n_stages * n_microbatches


def test_hand_written_schedule_gives_the_same_gradients():
    model = make_model("mlp")
    loss_fn = torch.nn.MSELoss()
    x, y = pl.models.sample_batch(model, 8)
    ref_loss, ref_grads = reference(model, x, y, loss_fn)
    # Backwards in reverse micro-batch order, written as a grid.
    schedule = pl.Schedule.from_text("""
        device 0 | F0 F1 F2 .  .  .  .  .  B2 B1 B0
        device 1 | .  F0 F1 F2 .  .  .  B2 B1 B0
        device 2 | .  .  F0 F1 F2 .  B2 B1 B0
        device 3 | .  .  .  F0 F1 F2 B2 B1 B0
    """)
    result = pl.Pipeline(model, n_stages=4, n_microbatches=3, schedule=schedule, loss_fn=loss_fn,
                         devices="cpu").step(x, y)
    assert_matches(model, result, ref_loss, ref_grads, "hand-written schedule")


def test_gradients_accumulate_across_steps_like_backward():
    model = make_model("mlp")
    loss_fn = torch.nn.MSELoss()
    x, y = pl.models.sample_batch(model, 12)
    _, ref_grads = reference(model, x, y, loss_fn)
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=4, schedule="1f1b", loss_fn=loss_fn, devices="cpu")
    pipe.step(x, y)
    pipe.step(x, y)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, 2 * g, **TOLERANCE)


def test_an_optimizer_over_model_parameters_just_works():
    model, twin = make_model("gpt"), make_model("gpt")
    loss_fn = pl.models.lm_loss
    x, y = pl.models.sample_batch(model, 10)
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=5, schedule="gpipe", loss_fn=loss_fn, devices="cpu")
    optimizer, twin_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    for _ in range(3):
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()
        twin_optimizer.zero_grad()
        loss_fn(twin(x), y).backward()
        twin_optimizer.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split_method", ["params", "time"])
def test_other_splits_are_exact_too(split_method):
    model = make_model("gpt")
    loss_fn = pl.models.lm_loss
    x, y = pl.models.sample_batch(model, 9)
    ref_loss, ref_grads = reference(model, x, y, loss_fn)
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=4, schedule="1f1b", loss_fn=loss_fn, devices="cpu",
                       split_method=split_method, sample=x)
    assert_matches(model, pipe.step(x, y), ref_loss, ref_grads, split_method)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", [True, False, True]])
def test_activation_checkpointing_keeps_gradients_exact(kind, schedule, checkpoint):
    model = make_model(kind)
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, BATCH, seed=3)
    ref_loss, ref_grads = reference(model, x, y, loss_fn)
    stage_counts = [3] if isinstance(checkpoint, list) else [1, 3, 8]
    for n_stages in stage_counts:
        for n_microbatches in (1, 5, 16):
            model.zero_grad(set_to_none=True)
            pipe = pl.Pipeline(model, n_stages=n_stages, n_microbatches=n_microbatches, schedule=schedule,
                               loss_fn=loss_fn, devices="cpu",
                               checkpoint=checkpoint)
            result = pipe.step(x, y)
            assert_matches(model, result, ref_loss, ref_grads,
                           f"{kind} {schedule} checkpoint={checkpoint} p={n_stages} m={n_microbatches}")
