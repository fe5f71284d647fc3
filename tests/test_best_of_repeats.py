"""Timed profiles keep the fastest of their repeats: other work only ever adds time.

A block that sleeps a scripted time in each forward and backward stands in for a machine
that is busy during some runs: slow, slow, fast.  The median of those three reads slow, the
best reads fast.
"""

import time

import pytest
import torch
from torch import nn

import pipelab as pl

SLOW, FAST = 0.060, 0.004  # seconds


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Scripted(nn.Module):
    """A Linear layer whose n-th forward (and its backward) sleeps `delays[n]` seconds."""

    def __init__(self, delays):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.delays = list(delays)

    def forward(self, x):
        seconds = self.delays.pop(0)
        time.sleep(seconds)
        return _SleepInBackward.apply(self.linear(x), seconds)


def scripted_model():
    # three timed runs; a profile then runs one more forward, untimed (what a split backward keeps for W)
    return nn.Sequential(Scripted([SLOW, SLOW, FAST, FAST]), nn.Linear(4, 4))


def test_from_profile_keeps_the_fastest_run_of_each_stage():
    model = scripted_model()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    costs = pl.Costs.from_profile(model, pl.split(model, 2), (x, y), nn.MSELoss(), repeats=3)
    assert costs.forward[0] < SLOW / 2 and costs.backward[0] < SLOW / 2  # the median would read SLOW
    assert costs.forward[0] >= FAST and costs.backward[0] >= FAST


def test_split_by_time_keeps_the_fastest_run_of_each_block():
    model = scripted_model()
    parts = pl.split(model, 2, method="time", sample=torch.randn(2, 4), repeats=3)
    assert 2 * FAST <= parts.block_costs[0] < SLOW  # forward + backward of the fast run; the median: 2 x SLOW


@pytest.mark.parametrize("repeats", [0, -1, 2.5, True])
def test_repeats_must_be_a_positive_int(repeats):
    model = pl.models.mlp(depth=2, width=4)
    x, y = pl.models.sample_batch(model, 2)
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        pl.Costs.from_profile(model, pl.split(model, 2), (x, y), nn.MSELoss(), repeats=repeats)
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        pl.split(model, 2, method="time", sample=x, repeats=repeats)
