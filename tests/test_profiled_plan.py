"""pl.plan on a profiled model (predict/profiled_model.py): its cut, its step against the simulator, its memory."""

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.predict.profiled_model import ProfiledModel
from pipelab.schedules import gpipe, one_f_one_b, zero_bubble_h1

FREE = (0.0, 1e30)  # links with no latency and no transfer time
MIB = 2**20


def profile(n_blocks=8, forward=1.0, backward=2.0, kept=4 * MIB, output=MIB, parameters=1000, b=2):
    return ProfiledModel(micro_batch_size=b, forward=(forward,) * n_blocks, backward=(backward,) * n_blocks,
                         kept_bytes=(kept,) * n_blocks, output_bytes=(output,) * n_blocks, input_bytes=MIB / 2,
                         parameters=(parameters,) * n_blocks)


def rows(found, layout, schedule, recompute="none"):
    return [r for r in found.rows + found.over_limit
            if r.layout == layout and r.schedule == schedule and r.recompute == recompute]


@pytest.mark.parametrize("name, make", [("gpipe", gpipe), ("1f1b", one_f_one_b), ("zb-h1", zero_bubble_h1)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 4)])
def test_the_step_is_the_simulators_on_equal_blocks(name, make, p, m):
    """Equal blocks cut into equal stages: the closed form is the simulator's makespan of the same schedule."""
    model = profile(n_blocks=8)
    found = pl.plan(model, n_devices=p, devices_per_node=p, memory_bytes=2**40, global_batch=m * 2,
                    inside=FREE, between=FREE)
    [row] = rows(found, pl.Layout(pp=p), name)
    assert row.micro_batch_size == 2 and row.n_microbatches == m
    per_stage = 8 // p
    if name == "zb-h1":  # W is weight_share = 1/2 of the backward
        costs = pl.Costs(forward=per_stage * 1.0, backward=per_stage * 1.0, weight=per_stage * 1.0)
    else:
        costs = pl.Costs(forward=per_stage * 1.0, backward=per_stage * 2.0)
    assert row.step_seconds == pytest.approx(pl.simulate(make(p, m), costs).makespan)


def test_the_cut_balances_unequal_blocks_and_the_busiest_stage_sets_the_pace():
    model = ProfiledModel(micro_batch_size=1, forward=(3, 1, 1, 1), backward=(6, 2, 2, 2), kept_bytes=(1,) * 4,
                          output_bytes=(1,) * 4, input_bytes=1, parameters=(1,) * 4)
    assert model.cut(2) == [(0, 1), (1, 4)]
    work = model.stage_work(2, 1, "none", 0.5, split_weight=False)
    assert (work.forward, work.backward) == (3, 6)


def test_memory_per_device_is_states_plus_in_flight_activations():
    model = profile(n_blocks=8, kept=4 * MIB, parameters=1000)
    found = pl.plan(model, n_devices=4, devices_per_node=4, memory_bytes=2**40, global_batch=16, inside=FREE,
                    between=FREE)
    [one] = rows(found, pl.Layout(pp=4), "1f1b")  # m = 8: the first stage holds min(p, m) = 4 micro-batches
    assert one.memory.parameters == 2 * 1000 * 4 and one.memory.optimizer == 2 * 1000 * 8  # fp32 Adam
    assert one.memory.activations == 4 * 2 * 4 * MIB
    [full] = rows(found, pl.Layout(pp=4), "1f1b", "full")  # only the stage's input, + one stage rebuilt
    assert full.memory.activations == 4 * MIB / 2 + 2 * 4 * MIB
    assert full.seconds["compute"] == pytest.approx(8 * (2 * 1.0 + 2 * 2.0 + 2 * 1.0))  # the forward again
    [all_of_it] = rows(found, pl.Layout(pp=4), "gpipe")
    assert all_of_it.memory.activations == 8 * 2 * 4 * MIB


def test_what_a_profile_cannot_plan_says_why():
    found = pl.plan(profile(n_blocks=2), n_devices=4, devices_per_node=4, memory_bytes=2**40, global_batch=8,
                    inside=FREE, between=FREE)
    why = dict(found.impossible)
    assert why[pl.Layout(tp=4)] == "tp=4: a profiled model's blocks have no tensor-parallel plan (tp=1 only)"
    assert why[pl.Layout(pp=4)] == "pp=4 stages for 2 profiled blocks would leave a stage empty"
    assert {r.recompute for r in found.rows} == {"none", "full"}
    with pytest.raises(ValueError, match="one forward, backward"):
        ProfiledModel(1, (1.0,), (), (1,), (1,), 1, (1,))
    with pytest.raises(ValueError, match="peak_flops_per_second"):
        pl.plan(pl.TransformerSpec(layers=2, hidden=8, heads=2, seq=4, vocab=8), n_devices=2, devices_per_node=2,
                memory_bytes=2**30, global_batch=4, inside=FREE, between=FREE)


def test_measure_profiles_every_block_of_a_real_model():
    model = pl.models.mlp(depth=4, width=32, seed=0)
    x, y = pl.models.sample_batch(model, 8, seed=1)
    measured = ProfiledModel.measure(model, (x, y), nn.MSELoss(), repeats=2)
    assert measured.micro_batch_size == 8 and measured.n_blocks == len(model)
    assert sum(measured.parameters) == sum(q.numel() for q in model.parameters())
    assert all(t > 0 for t in measured.forward + measured.backward)
    assert measured.input_bytes == x.numel() * 4 and measured.output_bytes[0] == 8 * 32 * 4
    found = pl.plan(measured, n_devices=2, devices_per_node=2, memory_bytes=2**30, global_batch=32,
                    inside=(1e-5, 1e9), between=(1e-5, 1e9))
    assert {r.layout for r in found.rows} == {pl.Layout(dp=2), pl.Layout(pp=2)}
    assert all(r.micro_batch_size == 8 for r in found.rows)
    with pytest.raises(TypeError, match="nn.Sequential"):
        ProfiledModel.measure(nn.Linear(2, 2), (torch.zeros(1, 2), torch.zeros(1, 2)), nn.MSELoss())
