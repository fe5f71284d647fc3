"""The planner-against-measurement check (course/planner_check.py): its cut, its plan, and runs that are exact.

The timing targets live in benchmarks/planner.py (part 3); here: every layout the check times computes the
single-device loss and gradients' step, cut the way the planner assumes, with the plan the check reports.
"""

import pytest

import pipelab as pl
from pipelab.course import planner_check
from pipelab.predict.transformer_memory import TransformerSpec

TINY = TransformerSpec(layers=4, hidden=32, heads=2, seq=8, vocab=64, bytes_per_value=4)


@pytest.mark.parametrize("n_stages, bounds", [(1, [(0, 6)]), (2, [(0, 3), (3, 6)]),
                                              (4, [(0, 2), (2, 3), (3, 4), (4, 6)])])
def test_the_cut_is_the_planners(n_stages, bounds):
    """⌈L/p⌉ layers a stage, the embedding with the first, the output layer with the last (planner.py)."""
    model = planner_check.make_model(TINY)
    partition = planner_check.planner_partition(model, TINY.layers, n_stages)
    assert partition.bounds == bounds
    assert [len(stage) for stage in partition.stages] == [b - a for a, b in bounds]
    with pytest.raises(ValueError, match="do not split into 3 equal stages"):
        planner_check.planner_partition(model, TINY.layers, 3)


def test_the_plan_uses_the_calibration_and_only_what_the_engine_runs():
    calibration = {"flops": {1: 1e9, 2: 2e9}, "latency": 1e-4, "bandwidth": 1e9}
    scenario = planner_check.Scenario("tiny", TINY, 8, 2**30, micro_batch_sizes=(1, 2))
    found = planner_check.plan_for(scenario, calibration)
    assert {r.schedule for r in found.rows} <= {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert {r.recompute for r in found.rows} <= {"none", "full"} and {r.chunks for r in found.rows} <= {1, 2}
    assert {r.layout for r in found.rows} == set(pl.Layout.all_for(4)) - {pl.Layout(tp=4)}  # 2 heads: tp <= 2
    # compute at X_b: a dp=4 row's compute time is its FLOPs over X_b
    row = next(r for r in found.rows if r.layout == pl.Layout(dp=4) and r.micro_batch_size == 2)
    assert row.seconds["compute"] == pytest.approx(row.n_microbatches * TINY.iteration_flops(2) / 2e9)


def test_every_layout_it_times_is_exact():
    scenario = planner_check.Scenario("tiny", TINY, 8, 2**30, micro_batch_sizes=(1, 2))
    [outcome] = planner_check.check([scenario], repeats=1, timeout_seconds=300)
    assert len(outcome.runs) == 5  # every layout that fits ran (tp=4 cannot split 2 heads)
    assert outcome.choice.row == planner_check.plan_for(scenario, outcome.calibration).best
    assert all(run.loss_error < 1e-5 for run in outcome.runs), [run.loss_error for run in outcome.runs]
    assert all(run.measured_seconds > 0 for run in outcome.runs)
    calibration = outcome.calibration
    assert set(calibration["flops"]) == {1, 2, (1, 2), (2, 2)} and calibration["latency"] >= calibration["idle_latency"] > 0
    text = planner_check.table([outcome]) + planner_check.detail(outcome)
    assert "tiny" in text and "regret" in text and text.count("predicted") == 5
