"""What a rank says it waits for (runtime/launcher/progress.py), read back as its launcher reads it.

Reference: DESIGN.md's dependency rules, written out here per kind: F and E (forward only) wait for
an activation from the device of stage s-1; B and I for a gradient from the device of stage s+1;
stage 0's F, the last stage's B and every W wait for nothing from another device.
"""

import pytest

import pipelab as pl
from pipelab.runtime.launcher import progress


@pytest.fixture
def report(tmp_path):
    reporter = progress.Reporter(tmp_path / "rank")

    def waiting(schedule, text):
        reporter.waiting(schedule, pl.Action.from_str(text))
        return progress.read(tmp_path / "rank")

    yield waiting
    reporter.finish("returned")


def test_a_forward_only_action_waits_for_an_activation(report):
    inference = pl.schedules.inference(3, 2)
    for text, sender in (("1E0", 0), ("2E1", 1)):
        state = report(inference, text)
        assert (state["phase"], state["action"]) == ("waiting", text)
        assert state["waiting_for"] == f"an activation from pipeline device {sender}"
    assert report(inference, "0E0")["phase"] == "computing"  # stage 0 starts from the batch


@pytest.mark.parametrize("schedule", [pl.schedules.one_f_one_b(3, 4), pl.schedules.zero_bubble_h1(3, 4)])
def test_training_actions_wait_for_activations_forward_and_gradients_back(report, schedule):
    backward = "I" if schedule.name == "zb-h1" else "B"
    assert report(schedule, "1F2")["waiting_for"] == "an activation from pipeline device 0"
    assert report(schedule, f"1{backward}2")["waiting_for"] == "a gradient from pipeline device 2"
    assert report(schedule, f"0{backward}0")["waiting_for"] == "a gradient from pipeline device 1"
    for text in ("0F1", f"2{backward}3"):  # the batch, the loss: nothing from another device
        assert report(schedule, text)["phase"] == "computing"
    if backward == "I":
        assert report(schedule, "1W0")["phase"] == "computing"  # W needs its own stage's I only
