"""The simulator against closed forms, and against the engine it predicts."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pipelab as pl
from reference_timing import reference_times
from pipelab.schedules.action import Action

SCHEDULES = [pl.schedules.gpipe, pl.schedules.one_f_one_b]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 32), m=st.integers(1, 128), t_f=st.floats(0.1, 5), ratio=st.floats(0.5, 3),
       generator=st.sampled_from(SCHEDULES))
def test_uniform_costs_match_the_closed_form(p, m, t_f, ratio, generator):
    """GPipe §2.3 / Megatron-LM SC21 §2.2.1: makespan (m+p-1)(t_F+t_B), bubble (p-1)/(m+p-1)."""
    t_b = ratio * t_f
    trace = pl.simulate(generator(p, m), pl.Costs(forward=t_f, backward=t_b))
    assert trace.makespan == pytest.approx((m + p - 1) * (t_f + t_b), rel=1e-9)
    assert trace.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert trace.source == "simulated"


@pytest.mark.parametrize("p", [2, 4, 8])
def test_one_microbatch_is_naive_model_parallelism(p):
    trace = pl.simulate(pl.schedules.gpipe(p, 1), pl.Costs(1.0, 2.0))
    assert trace.bubble_fraction == pytest.approx((p - 1) / p)
    busy_at = lambda t: sum(e.start <= t < e.end for e in trace.events)
    assert all(busy_at(k + 0.5) == 1 for k in range(int(trace.makespan)))  # one device busy at a time


@pytest.mark.parametrize("generator", SCHEDULES)
def test_the_slowest_stage_sets_the_steady_state(generator):
    p, m = 4, 64
    forward = [1.0, 1.0, 3.0, 1.0]
    trace = pl.simulate(generator(p, m), pl.Costs(forward=forward, backward=[2 * f for f in forward]))
    slowest = 3.0 + 6.0
    assert trace.makespan >= m * slowest
    assert trace.makespan <= m * slowest + sum(f + 2 * f for f in forward)  # plus one trip through the others
    assert trace.busy_time[2] == pytest.approx(m * slowest)


def test_communication_adds_to_the_critical_path():
    p, m, d = 4, 8, 0.25
    gpipe = pl.simulate(pl.schedules.gpipe(p, m), pl.Costs(1.0, 2.0, latency=d))
    # every hop of the first micro-batch down and of the last one back up pays d
    assert gpipe.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * d)
    by_bandwidth = pl.simulate(pl.schedules.gpipe(p, m), pl.Costs(1.0, 2.0, bandwidth=1000.0, activation_bytes=250.0))
    assert by_bandwidth.makespan == pytest.approx(gpipe.makespan)


@pytest.mark.parametrize("generator,expected", [(pl.schedules.gpipe, lambda p, m, s: m),
                                                (pl.schedules.one_f_one_b, lambda p, m, s: min(p - s, m))])
def test_simulated_memory_follows_the_inflight_count(generator, expected):
    p, m = 4, 6
    trace = pl.simulate(generator(p, m), pl.Costs(1.0, 2.0, memory_bytes=[10, 20, 30, 40]))
    for s in range(p):
        assert trace.peak_memory[s] == expected(p, m, s) * 10 * (s + 1)
        assert trace.memory_curve(s)[1][-1] == 0
    assert trace.peak_inflight == [expected(p, m, s) for s in range(p)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulating_measured_durations_gives_the_reference_timeline(schedule):
    """`simulate` fed an engine's measured durations, against the naive reference of DESIGN.md's rules
    (`tests/reference_timing.py`), with links that cost time between devices."""
    model = pl.models.mlp(depth=8, width=32)
    x, y = pl.models.sample_batch(model, 16)
    result = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule=schedule, loss_fn=torch.nn.MSELoss(),
                         devices="cpu").step(x, y)
    durations = result.trace.durations()
    sched = pl.schedules.by_name(schedule, 4, 8)
    replay = pl.simulate(sched, durations)
    start, end = reference_times(sched, durations.__getitem__)
    for e in replay.events:
        assert (e.start, e.end) == pytest.approx((start[e.action], end[e.action]), rel=1e-9, abs=1e-12)
    linked = pl.simulate(sched, pl.Costs(forward=[1.0, 2.0, 1.5, 1.0], backward=2.5, latency=0.25))
    start, end = reference_times(sched, lambda a: {"F": [1.0, 2.0, 1.5, 1.0]}.get(a.kind, [2.5] * 4)[a.stage],
                                 delay=lambda producer, consumer: 0.25)
    for e in linked.events:
        assert (e.start, e.end) == pytest.approx((start[e.action], end[e.action])), e


def test_bad_costs_are_named():
    with pytest.raises(ValueError, match="Costs.forward"):
        pl.Costs(forward=-1)
    with pytest.raises(ValueError, match="Costs.backward"):
        pl.Costs(backward=[1.0, math.nan])
    with pytest.raises(ValueError, match="bandwidth"):
        pl.Costs(bandwidth=0)
    with pytest.raises(ValueError, match="lists 2 values for 4 stages"):
        pl.simulate(pl.schedules.gpipe(4, 2), pl.Costs(forward=[1.0, 2.0]))
    with pytest.raises(TypeError, match="pl.Costs"):
        pl.simulate(pl.schedules.gpipe(2, 2), "fast")
    with pytest.raises(ValueError, match="no time for"):
        pl.simulate(pl.schedules.gpipe(2, 2), {Action("F", 0, 0): 1.0})


def test_costs_from_profile_measure_the_stages_and_keep_grads():
    model = pl.models.mlp(depth=4, width=16)
    parts = pl.split(model, 2)
    x, y = pl.models.sample_batch(model, 4)
    costs = pl.Costs.from_profile(model, parts, (x, y), torch.nn.MSELoss(), repeats=3)
    assert all(t > 0 for t in costs.forward + costs.backward)
    assert costs.activation_bytes[0] == 4 * 16 * 4  # stage 0 sends a (4 x 16) fp32 activation
    assert costs.memory_bytes[0] == 4 * (4 * 16 * 4)  # two Linear inputs and two GELU inputs
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("p,m", [(4, 8), (8, 32), (2, 1)])
def test_speedup_is_p_m_over_m_plus_p_minus_1(p, m):
    trace = pl.simulate(pl.schedules.one_f_one_b(p, m), pl.Costs(1.0, 3.0))
    assert trace.speedup == pytest.approx(p * m / (m + p - 1))
    assert trace.speedup == pytest.approx(p * (1 - trace.bubble_fraction))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_simulated_memory_matches_the_measured_bytes(kind, schedule, checkpoint):
    """Fed from Costs.from_profile, the simulator's counted bytes are the engine's counted bytes, exactly: the
    same saved-tensor count and the same rule (a consistency check).  The observed peak (storages really
    alive) is at least that; for the MLP at most that plus m + 2 activations of one micro-batch (an output
    until sent, messages arrived and waiting, at most one per micro-batch, a gradient until sent); how many
    wait depends on the measured durations.  The tiny GPT's stages hold far more than autograd saves
    (token ids, the embedding's output), so only the lower bound is stated for it."""
    if kind == "mlp":
        model = pl.models.mlp(depth=8, width=32)
    else:
        model = pl.models.tiny_gpt(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8)
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, 16)
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule=schedule, loss_fn=loss_fn, devices="cpu",
                       checkpoint=checkpoint)
    measured = pipe.step(x, y).trace
    costs = pl.Costs.from_profile(model, pipe.partition, (x[:2], y[:2]), loss_fn, repeats=1)
    predicted = pl.simulate(pipe.schedule, costs, checkpoint=checkpoint)
    assert predicted.peak_memory == measured.peak_memory
    activation = 2 * 32 * 4  # one micro-batch of 2 samples, 32 fp32 features
    for observed, counted in zip(measured.peak_memory_observed, measured.peak_memory):
        assert counted <= observed <= (counted + (8 + 2) * activation if kind == "mlp" else math.inf)


def test_checkpointing_in_the_simulator_costs_one_forward_and_saves_memory():
    costs = pl.Costs(forward=1.0, backward=2.0, memory_bytes=100.0, input_bytes=10.0)
    plain = pl.simulate(pl.schedules.one_f_one_b(4, 8), costs)
    ckpt = pl.simulate(pl.schedules.one_f_one_b(4, 8), costs, checkpoint="always")
    assert ckpt.makespan == pytest.approx((8 + 4 - 1) * (1.0 + 2.0 + 1.0))  # B becomes t_B + t_F
    assert plain.peak_memory[0] == 4 * 100
    assert ckpt.peak_memory[0] == 4 * 10 + (100 - 10)  # inputs of 4 in flight + one recomputation


def test_from_profile_leaves_existing_gradients_alone():
    model = pl.models.mlp(depth=4, width=16)
    x, y = pl.models.sample_batch(model, 8)
    torch.nn.MSELoss()(model(x), y).backward()
    before = [p.grad.clone() for p in model.parameters()]
    pl.Costs.from_profile(model, pl.split(model, 2), (x[:4], y[:4]), torch.nn.MSELoss(), repeats=2)
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)
