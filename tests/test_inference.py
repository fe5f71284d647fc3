"""Forward-only pipelines (inference): the E kind, `pl.schedules.inference`, the simulator's closed forms
and `Pipeline.infer` against the model's own forward on one device."""

import math

import pytest
import torch

import pipelab as pl
from pipelab import schedules
from pipelab.common.errors import ScheduleError
from pipelab.schedules.action import Action


@pytest.mark.parametrize("p, m", [(1, 1), (2, 5), (4, 8), (8, 3)])
def test_equal_stages_give_the_fill_drain_closed_forms(p, m):
    """Each micro-batch takes p·t through p stages of time t whatever m; the pass lasts (m + p − 1)·t, so the
    throughput is m / ((m + p − 1)·t) (GPipe §2.3's arithmetic without a backward); m·(p − 1) messages,
    all forward."""
    t = 0.25
    sched = schedules.validate(schedules.inference(p, m))
    trace = pl.simulate(sched, pl.Costs(forward=t, memory_bytes=100.0))
    assert trace.makespan == pytest.approx((m + p - 1) * t)
    assert trace.latencies == pytest.approx([p * t] * m)
    assert trace.throughput == pytest.approx(m / ((m + p - 1) * t))
    assert sched.message_count() == m * (p - 1)
    assert trace.peak_memory == [0] * p  # nothing kept for a backward
    assert trace.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_a_forward_only_schedule_runs_e_and_nothing_else():
    with pytest.raises(ScheduleError, match="forward-only schedule"):
        schedules.validate(pl.Schedule(2, 1, [[Action("E", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]))
    with pytest.raises(ScheduleError, match=r"missing action 1E1"):
        schedules.validate(pl.Schedule(2, 2, [[Action("E", 0, 0), Action("E", 0, 1)], [Action("E", 1, 0)]]))
    with pytest.raises(ScheduleError, match="comes later in the same list.*previous stage"):  # stuck
        schedules.validate(pl.Schedule(2, 1, [[Action("E", 1, 0), Action("E", 0, 0)]]))
    assert str(Action.from_str("3E2")) == "3E2"


def test_forward_only_like_keeps_the_placement_of_an_interleaved_schedule():
    sched = schedules.forward_only_like(schedules.interleaved_1f1b(2, 4, 2))
    schedules.validate(sched)
    assert sched.device_of_stage() == {0: 0, 1: 1, 2: 0, 3: 1}
    assert sched.message_count() == 4 * 3


def reference_output(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("kind, schedule", [("mlp", "1f1b"), ("mlp", "interleaved"), ("gpt", "gpipe")])
def test_infer_returns_the_models_own_output_and_keeps_nothing(kind, schedule):
    model = (pl.models.mlp(depth=8, width=32, seed=0) if kind == "mlp"
             else pl.models.tiny_gpt(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=6, seed=0))
    model.eval()
    x, y = pl.models.sample_batch(model, 20)  # 20 samples in 4 micro-batches of 5
    sched = schedules.interleaved_1f1b(2, 4, 2) if schedule == "interleaved" else schedule
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=4, schedule=sched, loss_fn=pl.models.default_loss(model),
                       devices="cpu")
    result = pipe.infer(x)
    torch.testing.assert_close(result.output, reference_output(model, x), rtol=0, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    trace = result.trace
    assert sorted(map(str, (e.action for e in trace.events))) == sorted(
        map(str, schedules.forward_only_like(pipe.schedule).all_actions()))
    assert trace.peak_memory == [0] * trace.n_devices
    # each micro-batch's latency spans its E's on every stage, at least their sum
    durations = trace.durations()
    for i, latency in enumerate(trace.latencies):
        assert latency >= sum(durations[Action("E", s, i)] for s in range(4)) - 1e-12
    assert trace.throughput == pytest.approx(4 / trace.makespan)
    # a training step afterwards is unaffected
    loss = pipe.step(x, y).loss
    expected = pl.models.default_loss(model)(model(x), y)
    assert math.isclose(loss, float(expected.detach()), rel_tol=1e-5)


def test_infer_on_a_model_split_by_names():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (4, 8))
    with_labels = {"input_ids": ids, "labels": ids}
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, split_points=["transformer.h.1"], sample=with_labels,
                       devices="cpu")
    with pytest.raises(ValueError, match="a sample without labels"):  # a loss per micro-batch: no batch to join
        pipe.infer(with_labels)
    sample = {"input_ids": ids}
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, split_points=["transformer.h.1"], sample=sample,
                       devices="cpu")
    result = pipe.infer(sample)
    with torch.no_grad():
        expected = model(**sample)
    torch.testing.assert_close(result.output.logits, expected.logits, rtol=0, atol=1e-5)


def ranks_infer(schedule_name: str) -> dict:
    """On every rank: a forward-only pass, then a training step, of a small MLP (2 ranks)."""
    model = pl.models.mlp(depth=8, width=32, seed=0)
    x, y = pl.models.sample_batch(model, 20)
    schedule = schedules.interleaved_1f1b(2, 4, 2) if schedule_name == "interleaved" else schedule_name
    pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule=schedule, loss_fn=torch.nn.MSELoss())
    first = pipe.infer(x)
    again = pipe.infer(x)  # the inference transport again, then training's
    loss = pipe.step(x, y).loss
    return {"output": first.output, "again": again.output, "trace": first.trace, "loss": loss,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


@pytest.mark.parametrize("schedule_name", ["1f1b", "interleaved"])
def test_infer_on_ranks_returns_the_models_output_on_the_last_stages_rank(schedule_name):
    seen = pl.distributed.launch(ranks_infer, 2, schedule_name, timeout_seconds=120)
    model = pl.models.mlp(depth=8, width=32, seed=0)
    x, y = pl.models.sample_batch(model, 20)
    expected = reference_output(model, x)
    last_rank = 1  # the last stage is on rank 1 for both placements
    assert seen[0]["output"] is None
    torch.testing.assert_close(seen[last_rank]["output"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(seen[last_rank]["again"], expected, rtol=0, atol=1e-6)
    trace = seen[0]["trace"]
    assert trace.source == "measured" and {e.kind for e in trace.events} == {"E"}
    n_stages = 4 if schedule_name == "interleaved" else 2
    assert len(trace.events) == 4 * n_stages and len(trace.messages) == 4 * (n_stages - 1)
    assert trace.peak_memory == [0, 0]
    assert all(latency > 0 for latency in trace.latencies) and trace.throughput == pytest.approx(4 / trace.makespan)
    loss = torch.nn.MSELoss()(model(x), y)  # the training step after it: the single-device step
    loss.backward()
    assert math.isclose(seen[0]["loss"], float(loss), rel_tol=1e-5)
    grads = {**seen[0]["grads"], **seen[1]["grads"]}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
