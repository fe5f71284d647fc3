"""The schedules beyond 1F1B on the local engine: same loss and gradients as the single-device step.

Reference: `loss_fn(model(x), y).backward()` on the whole batch, plain autograd, as in
tests/test_equivalence.py.  Interleaved 1F1B puts several stages on one device: the
engine runs any valid table, so the Pipeline has p·v stages and the Schedule p devices.
"""

import pytest
import torch

import pipelab as pl
from pipelab import schedules

BATCH = 19  # prime: uneven micro-batches for every m > 1
TOLERANCE = dict(rtol=1e-5, atol=1e-6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(kind, n_blocks):
    if kind == "mlp":
        return pl.models.mlp(depth=n_blocks, width=16, seed=1)
    return pl.models.tiny_gpt(n_layers=max(n_blocks - 2, 1), d_model=16, n_heads=2, vocab_size=32, seq_len=6, seed=1)


def reference(model, x, y, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_step_matches(model, schedule, x, y, loss_fn, where):
    ref_loss, ref_grads = reference(model, x, y, loss_fn)
    pipe = pl.Pipeline(model, schedule.n_stages, schedule.n_microbatches, schedule, loss_fn, devices="cpu")
    result = pipe.step(x, y)
    torch.testing.assert_close(torch.tensor(result.loss, dtype=ref_loss.dtype), ref_loss, **TOLERANCE,
                               msg=lambda m: f"{where}: loss differs\n{m}")
    for (name, p), g in zip(model.named_parameters(), ref_grads):
        assert p.grad is not None, f"{where}: {name} got no gradient"
        torch.testing.assert_close(p.grad, g, **TOLERANCE, msg=lambda m: f"{where}: grad of {name}\n{m}")
    return result


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("p, v", [(1, 2), (2, 2), (2, 3), (3, 2), (4, 2)])
def test_interleaved_equals_single_device_step(kind, p, v):
    model = make_model(kind, max(p * v, 3))
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    for m in (p, 2 * p, 3 * p):
        sched = schedules.interleaved_1f1b(p, m, v)
        result = assert_step_matches(model, sched, x, y, loss_fn, f"{kind} interleaved p={p} v={v} m={m}")
        trace = result.trace
        assert trace.n_devices == p and len(trace.events) == 2 * p * v * m
        assert {e.device for e in trace.events if e.stage % p == 1 % p} == {1 % p}


def test_pytorch_interleaved_tables_run_exactly_too():
    model = make_model("mlp", 8)
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    for name in ("Interleaved1F1B", "LoopedBFS"):
        sched = schedules.validate(schedules.torch_schedule(name, 4, 8, n_chunks=2))
        assert_step_matches(model, sched, x, y, loss_fn, f"torch {name}")
