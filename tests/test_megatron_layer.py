"""Lesson 08 §4's layer written by hand (pipelab/course/megatron_layer.py): what one rank saves for its backward,
part by part, against Korthikanti et al. 2022's count; split over t ranks it computes the whole layer; and with
task 4.2's reference f and g on two gloo ranks it saves the same bytes and gets the whole layer's gradients."""

import sys

import cloudpickle
import pytest
import torch

import pipelab as pl
from pipelab.course import megatron_layer as ml
from solutions import tensor_parallel as task_4_2  # the reference answer: tests only (not in a student copy)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_one_rank_saves_korthikanti_s_count_part_by_part(tp):
    count = ml.count_saved(ml.LESSON, tp=tp, rank=tp - 1)
    sbh = ml.LESSON.sbh
    assert {part: count.parts[part] / sbh for part in ml.PARTS} == ml.formula_parts(ml.LESSON, tp)
    # what the formula leaves out: the two layer norms' mean and 1/std, one 16-bit value per token each
    assert count.parts["other"] == 4 * ml.LESSON.seq * ml.LESSON.batch * 2
    assert abs(count.total / ml.formula_bytes(ml.LESSON, tp) - 1) < 0.01
    assert count.freed_after_backward


@pytest.mark.parametrize("tp", [2, 4])
def test_the_split_layer_is_the_whole_layer(tp):
    assert ml.split_difference(ml.LESSON, tp) < 1e-12


@pytest.mark.parametrize("shape", [ml.LESSON, ml.LayerShape(seq=32, batch=1, hidden=64, heads=8)])
def test_the_formula_is_the_planner_s(shape):
    spec = pl.TransformerSpec(layers=1, hidden=shape.hidden, heads=shape.heads, seq=shape.seq, vocab=8)
    for tp in (1, 2, 4):
        assert ml.formula_bytes(shape, tp) == pytest.approx(spec.layer_activation_bytes(shape.batch, tp))
        assert ml.formula_bytes(shape, tp, sequence_parallel=True) == pytest.approx(
            spec.layer_activation_bytes(shape.batch, tp, sequence_parallel=True))
        assert sum(ml.formula_parts(shape, tp).values()) * shape.sbh == pytest.approx(ml.formula_bytes(shape, tp))


def test_shards_put_back_together_are_the_whole_layer():
    shape = ml.LayerShape(seq=4, batch=1, hidden=16, heads=4)
    whole = ml.whole_layer(shape, seed=3)
    parts = [ml.shard(whole, shape, 2, r) for r in range(2)]
    d = shape.hidden // shape.heads
    assert torch.equal(torch.cat([p["qkv_w"].view(2, 3 * d, 16) for p in parts]).reshape(-1, 16), whole["qkv_w"])
    assert torch.equal(torch.cat([p["fc1_w"] for p in parts]), whole["fc1_w"])
    assert torch.equal(torch.cat([p["fc2_w"] for p in parts], dim=1), whole["fc2_w"])
    assert torch.equal(torch.cat([p["proj_w"] for p in parts], dim=1), whole["proj_w"])
    with pytest.raises(ValueError, match="must divide the 4 heads"):
        ml.shard(whole, shape, 3, 0)


def with_task_4_2_on_this_rank(shape):
    """Rank r of 2: the layer with task 4.2's reference f and g over the group of both ranks."""
    import torch.distributed as dist

    rank, group = dist.get_rank(), dist.new_group([0, 1])

    def f(x):
        return task_4_2.CopyToParallelRegion.apply(x, group)

    def g(x):
        return task_4_2.ReduceFromParallelRegion.apply(x, group)

    count = ml.count_saved(shape, 2, rank, f=f, g=g)
    whole = ml.whole_layer(shape, 0, torch.float64)
    x = ml._input(shape, 0, torch.float64)
    results = []
    for weights, ff, gg in ((ml.shard(whole, shape, 1, 0), ml._identity, ml._identity),
                            (ml.shard(whole, shape, 2, rank), f, g)):
        xx = x.clone().requires_grad_()
        out = ml.layer_forward(xx, weights, shape, 2 if ff is f else 1, ff, gg, dropout=0.0)
        out.backward(torch.cos(out.detach()))
        results.append((out.detach(), xx.grad, weights["ln1_w"].grad))
    (out_1, dx_1, dln_1), (out_2, dx_2, dln_2) = results
    difference = max(float((a - b).abs().max()) for a, b in ((out_1, out_2), (dx_1, dx_2), (dln_1, dln_2)))
    return count._asdict(), difference


def test_with_task_4_2_s_f_and_g_on_two_ranks_the_same_bytes_and_the_whole_layer_s_gradients():
    cloudpickle.register_pickle_by_value(task_4_2)  # the ranks unpickle these without the repository on their path
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    per_rank = pl.distributed.launch(with_task_4_2_on_this_rank, 2, ml.LESSON, timeout_seconds=120)
    in_one_process = ml.count_saved(ml.LESSON, 2, 0)
    for count, difference in per_rank:
        count = ml.LayerCount(**count)
        assert count.parts == in_one_process.parts and count.freed_after_backward
        assert difference < 1e-10
