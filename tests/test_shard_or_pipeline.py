"""Lesson 08's "pipeline it, or shard it?" (pipelab/course/shard_or_pipeline.py) against closed forms written
here by hand, not through predict/fsdp_formulas.py.

The MLP has 8 blocks Linear(256, 256): each 256·256 + 256 = 65,792 float32 parameters, W = 263,168 bytes.  A stage
of PP2 holds 4 blocks, P = 4W; of PP4 2 blocks, 2W.  After an AdamW step a rank holds (ZeRO §5, Figure 1), with
n tensors of its stage (2 a block) and AdamW's 4-byte step count for each:

    PP2×DP2    P parameters,  P gradients,  2P + 4n optimizer
    PP4        the same with its stage's 2W
    PP2×FSDP2  P/2,           P/2,          2·P/2 + 4n          (each first dimension, 256, splits evenly)

Bytes one step hands to the calls, summed over the 4 ranks, B = 16 samples of 256 float32 values:
"pp" 2(p−1)·B·1024 (each boundary, forward and back); "dp" each rank all-reduces its P: 4P;
FSDP's reduce-scatters are given each block's whole gradient once: 4P; its all-gathers each rank's half of a
block, 2m times a block when resharding (F and B of each micro-batch), once when kept: 4·(2m)·P/2 = 4mP or 2P.
One launch of 4 ranks, m = 2, a sweep over m = 1, 2 (the lesson runs m = 4 and 1..8 under nbval).
"""

import pytest
from matplotlib.figure import Figure

import pipelab.course.shard_or_pipeline as lesson

W = (256 * 256 + 256) * 4
P2, P4 = 4 * W, 2 * W  # a stage's parameter bytes under PP2 and PP4
BATCH_BYTES = 16 * 256 * 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def found():
    return lesson.run("mlp", n_microbatches=2, sweep=(1, 2), rounds=1, timeout_seconds=120)


def test_model_state_per_rank_is_zeros_table(found):
    expected = {"PP2×FSDP2": (P2 // 2, 8), "PP2×FSDP2 kept": (P2 // 2, 8), "PP2×DP2": (P2, 8), "PP4": (P4, 4)}
    for name, (held, tensors) in expected.items():
        row = found.layouts[name]
        assert row.state_observed == {"parameters": held, "gradients": held, "optimizer": 2 * held + 4 * tensors}, name
        assert row.state_predicted == {"parameters": held, "gradients": held, "optimizer": 2 * held}, name
        assert row.worst_state_ratio() == pytest.approx(4 * tensors / (2 * held))


def test_during_the_step_fsdp_holds_the_whole_gradient(found):
    assert {name: row.gradients_in_step for name, row in found.layouts.items()} == {
        "PP2×FSDP2": P2, "PP2×FSDP2 kept": P2, "PP2×DP2": P2, "PP4": P4}


def test_bytes_per_kind_are_the_closed_forms(found):
    m = 2
    pp2, pp4 = 2 * 1 * BATCH_BYTES, 2 * 3 * BATCH_BYTES
    expected = {"PP2×FSDP2": {"pp": pp2, "dp": 0, "fsdp_gather": 4 * m * P2, "fsdp_reduce_scatter": 4 * P2},
                "PP2×FSDP2 kept": {"pp": pp2, "dp": 0, "fsdp_gather": 2 * P2, "fsdp_reduce_scatter": 4 * P2},
                "PP2×DP2": {"pp": pp2, "dp": 4 * P2, "fsdp_gather": 0, "fsdp_reduce_scatter": 0},
                "PP4": {"pp": pp4, "dp": 0, "fsdp_gather": 0, "fsdp_reduce_scatter": 0}}
    for name, kinds in expected.items():
        row = found.layouts[name]
        assert row.bytes_counted == kinds and row.bytes_formula == kinds, name
        assert row.step_seconds > 0


def test_the_gathers_grow_with_m_only_when_resharding(found):
    assert found.sweep == {True: [(1, 4 * P2, 4 * P2), (2, 8 * P2, 8 * P2)],
                           False: [(1, 2 * P2, 2 * P2), (2, 2 * P2, 2 * P2)]}
    assert len({round(row.loss, 5) for row in found.layouts.values()}) == 1  # the same step in every layout
    figure = lesson.plot_gathers(found)
    assert isinstance(figure, Figure) and len(figure.axes[0].lines) == 2


def test_the_answer_follows_the_measured_times(found):
    text = lesson.answer(found)
    deep, sharded = found.layouts["PP4"], found.layouts["PP2×FSDP2"]
    assert f"{deep.step_seconds * 1e3:.0f} ms" in text and f"{sharded.step_seconds * 1e3:.0f} ms" in text
    for name in ("PP4", "PP2×FSDP2", "PP2×FSDP2 kept"):
        for other, row in found.layouts.items():  # this module's copy: later tests read no times
            row.step_seconds = 1e-3 if other == name else 1.0
        text = lesson.answer(found)
        assert ("pipeline it" in text) == (name == "PP4") and f"{name} is the fastest" in text


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="n_microbatches=3 must be one of sweep"):
        lesson.run("mlp", n_microbatches=3, sweep=(1, 2))
    with pytest.raises(ValueError, match="kind='cnn'"):
        lesson.make_model("cnn")
