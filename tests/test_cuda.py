"""CUDA paths. Skipped without a GPU; `scripts/gpu_check.sh` runs them on a GPU machine."""

import pytest
import torch

import pipelab as pl

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def reference(model, x, y, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


@pytest.mark.parametrize("devices", ["auto", "cuda", "mixed"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cuda_step_equals_single_device_step(devices, schedule):
    model = pl.models.tiny_gpt(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8, seed=0)
    x, y = pl.models.sample_batch(model, 12)
    ref_loss, ref_grads = reference(model, x, y, pl.models.lm_loss)  # on the CPU
    if devices == "mixed":
        devices = ["cuda:0", "cpu", "cuda:0", "cpu"]
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=6, schedule=schedule, loss_fn=pl.models.lm_loss,
                       devices=devices)
    result = pipe.step(x, y)
    assert result.loss == pytest.approx(ref_loss, rel=1e-4)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-4, atol=1e-5)  # TF32 and GPU kernels
    assert all(e.duration > 0 for e in result.trace.events)
    allocated = [s for s in result.trace.memory if s.what == "allocated"]
    assert allocated and all(s.bytes > 0 for s in allocated)
    expected = "measured" if torch.cuda.device_count() >= 4 and devices == "auto" else "replayed"
    assert result.trace.source == expected


def test_auto_places_one_stage_per_gpu_or_shares():
    from pipelab.runtime.devices import assign_devices

    n_gpus = torch.cuda.device_count()
    placed = assign_devices("auto", 4)
    assert all(d.type == "cuda" for d in placed)
    assert len({d for d in placed}) == min(n_gpus, 4)
    assert [d.index for d in placed] == sorted(d.index for d in placed)  # neighbours share


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the distributed engine on NCCL needs one GPU per rank")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_distributed_engine_on_nccl_equals_single_device_step(schedule):
    import distributed_cases as cases

    n_ranks = min(torch.cuda.device_count(), 4)
    per_rank = pl.distributed.launch(cases.nccl_step, n_ranks, "gpt", schedule, 6, backend="nccl", threads=None)
    model = cases.make_model("gpt")
    x, y = pl.models.sample_batch(model, cases.BATCH, seed=2)
    ref_loss, ref_grads = reference(model, x, y, pl.models.default_loss(model))
    names = [n for n, _ in model.named_parameters()]
    assert [r["device"] for r in per_rank] == [f"cuda:{k}" for k in range(n_ranks)]
    found = {}
    for r in per_rank:
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-4) and r["source"] == "measured"
        found.update(r["grads"])
    assert sorted(found) == sorted(names)
    for name, g in zip(names, ref_grads):
        torch.testing.assert_close(found[name], g, rtol=1e-4, atol=1e-5)
