"""fastest_step: the shortest of the repeats, one step's gradients left in .grad."""

import pytest
import torch

import pipelab as pl
from pipelab.course.fastest import fastest_step


class ScriptedPipe:
    """Stands in for a Pipeline: each step returns the next prepared makespan and counts the zeroings."""

    def __init__(self, makespans):
        self.makespans = list(makespans)
        self.model = torch.nn.Linear(2, 2)
        self.calls = 0

    def step(self, inputs, targets):
        self.calls += 1
        seconds = self.makespans.pop(0)
        event = pl.Event("F", 0, 0, 0.0, seconds, 0)
        trace = pl.Trace([event], [], "simulated", 1, 1, 1)
        return type("Result", (), {"trace": trace})()


def test_picks_the_shortest_and_skips_the_warm_up():
    pipe = ScriptedPipe([0.001, 5.0, 2.0, 3.0])  # the warm-up is the fastest: it must not count
    assert fastest_step(pipe, None, None, repeats=3).makespan == 2.0
    assert pipe.calls == 4
    pipe = ScriptedPipe([4.0, 1.0])
    assert fastest_step(pipe, None, None, repeats=2, warm_up=False).makespan == 1.0


def test_gradients_are_one_steps_not_the_sum_of_the_repeats():
    model = pl.models.mlp(depth=4, width=16, seed=0)
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, batch_size=8)
    _, reference = pl.single_device_gradients(model, x, y, loss_fn)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule="1f1b", loss_fn=loss_fn, devices="cpu")
    trace = fastest_step(pipe, x, y, repeats=3)
    assert trace.n_stages == 2 and trace.n_microbatches == 4
    assert pl.max_gradient_difference(model, reference) < 1e-6


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_bad_repeats(repeats):
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        fastest_step(ScriptedPipe([1.0]), None, None, repeats=repeats)
