"""`pipelab.model.partition`: balanced contiguous cuts, and `pl.split` of a model into stages."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pipelab as pl
from pipelab.model.partition import balanced_bounds, uniform_bounds


def brute_force_best(costs, n_stages):
    """The smallest possible maximum stage cost, over every contiguous cut."""
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(costs[edges[k]:edges[k + 1]]) for k in range(n_stages)))
    return best


def assert_valid_bounds(bounds, n_blocks, n_stages):
    assert len(bounds) == n_stages
    assert bounds[0][0] == 0 and bounds[-1][1] == n_blocks
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
        assert b == c
    assert all(a < b for a, b in bounds), f"empty stage in {bounds}"


# --------------------------------------------------------------------------- balanced_bounds


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.integers(0, 20), min_size=1, max_size=9), data=st.data())
def test_balanced_bounds_is_optimal_against_brute_force(costs, data):
    n_stages = data.draw(st.integers(1, len(costs)))
    bounds = balanced_bounds(costs, n_stages)
    assert_valid_bounds(bounds, len(costs), n_stages)
    assert max(sum(costs[a:b]) for a, b in bounds) == brute_force_best(costs, n_stages)


@settings(max_examples=50, deadline=None)
@given(costs=st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=1, max_size=8), data=st.data())
def test_balanced_bounds_float_costs(costs, data):
    n_stages = data.draw(st.integers(1, len(costs)))
    bounds = balanced_bounds(costs, n_stages)
    assert_valid_bounds(bounds, len(costs), n_stages)
    assert max(sum(costs[a:b]) for a, b in bounds) == pytest.approx(brute_force_best(costs, n_stages), rel=1e-9)


def test_balanced_bounds_beats_greedy_on_a_hand_case():
    # greedy filling up to total/p = 5 gives [4], [1, 1, 1, 1, 1, 1] (max 6); the optimum is 5
    assert balanced_bounds([4, 1, 1, 1, 1, 1, 1], 2) == [(0, 2), (2, 7)]
    assert balanced_bounds([1, 1, 1, 10, 1, 1], 3) == [(0, 3), (3, 4), (4, 6)]


def test_balanced_bounds_errors():
    with pytest.raises(ValueError, match="finite and non-negative"):
        balanced_bounds([1, -1, 2], 2)
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3 stages"):
        balanced_bounds([1, 2], 3)
    with pytest.raises(ValueError, match="n_stages must be at least 1, got 0"):
        balanced_bounds([1, 2], 0)
    with pytest.raises(TypeError, match="n_stages must be an int"):
        balanced_bounds([1, 2], 1.0)


@pytest.mark.parametrize("costs", [[math.inf, 1.0, 1.0], [1.0, 1.0, math.inf]])
def test_balanced_bounds_with_an_infinite_cost_raises_or_stays_valid(costs):
    try:
        bounds = balanced_bounds(costs, 2)
    except ValueError as error:
        assert re.search(r"finite|inf", str(error))
    else:
        assert_valid_bounds(bounds, 3, 2)


def test_balanced_bounds_rejects_nan_costs():
    with pytest.raises(ValueError, match=r"nan|finite"):
        balanced_bounds([1.0, math.nan, 1.0], 2)


# --------------------------------------------------------------------------- uniform_bounds


def test_uniform_bounds_sizes():
    for n_blocks in range(1, 30):
        for n_stages in range(1, n_blocks + 1):
            bounds = uniform_bounds(n_blocks, n_stages)
            assert_valid_bounds(bounds, n_blocks, n_stages)
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)  # the first stages get the extra block
    assert uniform_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_uniform_bounds_errors():
    with pytest.raises(ValueError, match="cannot cut 3 blocks into 4 stages"):
        uniform_bounds(3, 4)
    with pytest.raises(ValueError, match="n_stages must be at least 1"):
        uniform_bounds(3, -1)


# --------------------------------------------------------------------------- split


def small_blocks(n=6, width=8):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)])


def test_split_uniform_stages_share_the_models_parameters():
    model = small_blocks(7)
    parts = pl.split(model, 3)
    assert parts.bounds == [(0, 3), (3, 5), (5, 7)] and parts.method == "uniform" and len(parts) == 3
    assert all(isinstance(stage, nn.Sequential) for stage in parts.stages)
    stage_params = [p for stage in parts.stages for p in stage.parameters()]
    model_params = list(model.parameters())
    assert len(stage_params) == len(model_params)
    assert all(a is b for a, b in zip(stage_params, model_params))
    for stage, (a, b) in zip(parts.stages, parts.bounds):
        assert all(x is y for x, y in zip(stage, list(model)[a:b]))
    # running the stages in a row is running the model, and gradients land in the model
    x = torch.randn(5, 8)
    out = x
    for stage in parts.stages:
        out = stage(out)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_split_params_isolates_one_huge_block():
    width = 8
    blocks = [nn.Linear(width, width) for _ in range(6)]
    blocks[2] = nn.Sequential(nn.Linear(width, 512), nn.Linear(512, width))
    model = nn.Sequential(*blocks)
    small, huge = width * width + width, (width * 512 + 512) + (512 * width + width)  # 72, 8712
    parts = pl.split(model, 3, method="params")
    assert parts.block_costs == [small, small, huge, small, small, small]
    assert parts.bounds == [(0, 2), (2, 3), (3, 6)]
    assert parts.stage_costs == [2 * small, huge, 3 * small]
    assert pl.split(model, 3).bounds == [(0, 2), (2, 4), (4, 6)]  # uniform would pair it


def test_split_time_runs_returns_valid_bounds_and_leaves_grads_alone():
    model = pl.models.mlp(depth=5, width=16, seed=0)
    model.train()
    x, _ = pl.models.sample_batch(model, 4)
    before = [p.detach().clone() for p in model.parameters()]
    parts = pl.split(model, 3, method="time", sample=x)
    assert_valid_bounds(parts.bounds, 5, 3)
    assert parts.method == "time" and len(parts.block_costs) == 5
    assert all(c > 0 and math.isfinite(c) for c in parts.block_costs)
    # the cut is optimal for the costs it measured
    assert max(parts.stage_costs) == pytest.approx(brute_force_best(parts.block_costs, 3))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert model.training and not x.requires_grad


def test_split_time_keeps_existing_grads_and_eval_mode():
    model = small_blocks(3)
    model(torch.randn(2, 8)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.eval()
    pl.split(model, 2, method="time", sample=torch.randn(2, 8))
    assert not model.training
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_split_time_on_tiny_gpt_with_integer_tokens():
    model = pl.models.tiny_gpt(n_layers=2, d_model=16, n_heads=2, vocab_size=11, seq_len=6)
    ids, _ = pl.models.sample_batch(model, 2)
    parts = pl.split(model, 2, method="time", sample=ids)
    assert_valid_bounds(parts.bounds, 4, 2)
    assert all(p.grad is None for p in model.parameters())


def test_split_time_on_a_parameter_free_model():
    model = nn.Sequential(nn.ReLU(), nn.Tanh(), nn.ReLU())
    parts = pl.split(model, 2, method="time", sample=torch.randn(3, 4))
    assert_valid_bounds(parts.bounds, 3, 2)


def test_split_errors():
    model = small_blocks(3)
    with pytest.raises(ValueError, match="n_stages must be at least 1, got 0"):
        pl.split(model, 0)
    with pytest.raises(ValueError, match="cannot cut 3 blocks into 4 stages"):
        pl.split(model, 4)
    with pytest.raises(TypeError, match="n_stages must be an int"):
        pl.split(model, "2")
    with pytest.raises(TypeError, match=r"nn\.Sequential between its blocks, and any other module \(Linear\) by tracing"):
        pl.split(nn.Linear(3, 3), 1)
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        pl.split([nn.Linear(3, 3)], 1)
    with pytest.raises(ValueError, match=r"unknown split method 'flops'.*uniform.*params.*time"):
        pl.split(model, 2, method="flops")
    with pytest.raises(ValueError, match=r'method="time".*sample'):
        pl.split(model, 2, method="time")
    with pytest.raises(ValueError, match="no blocks"):
        pl.split(nn.Sequential(), 1)

