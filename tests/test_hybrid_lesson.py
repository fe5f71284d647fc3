"""Lesson 08's functions (pipelab/course/hybrid_lesson.py) beside what they are built on.

`run_layouts` itself runs in the lesson under nbval (its engine is tested in tests/test_hybrid.py)."""

import pipelab as pl
import pipelab.course.hybrid_lesson as lesson
from pipelab.predict.hybrid_costs import cluster_links, predict
from pipelab.predict.comm_formulas import step_bytes


def test_real_runs_multiply_to_their_gpus():
    assert all(dp * pp * tp == gpus for _, gpus, dp, pp, tp, _ in lesson.REAL_RUNS)


def test_layout_view_prints_the_prediction():
    layout = pl.Layout(dp=1, pp=2, tp=8)
    links = cluster_links(layout, 8, (5e-6, 300e9), (20e-6, 25e9))
    found = predict(layout, lesson.CLUSTER_MODEL, links, 16)
    text = lesson.layout_view(dp=1, tp=8)
    assert text.startswith(f"{layout}: step {found.step_seconds:.2f} s")
    assert "tp:" in text and "inside a node" in text.split("tp:")[1].splitlines()[0]
    assert "between nodes" in lesson.layout_view(dp=1, tp=16).split("tp:")[1].splitlines()[0]


def test_table_lines_up_measured_and_formula():
    row = lesson.LayoutRun(pl.Layout(pp=2, tp=2), 1.0, 1.0, 0.0, {k: 8 for k in lesson.KINDS},
                           {k: 8 for k in lesson.KINDS}, 100, 50)
    lines = lesson.table([row]).splitlines()
    assert len(lines) == 2 and lines[1].startswith("dp=1 pp=2 tp=2") and lines[1].count("8/8") == 4


def test_step_bytes_sums_the_ranks_counted_and_formula():
    model = lesson.make_model("mlp")  # width 32
    counts = [{k: {"bytes": 10 * (r + 1)} for k in lesson.KINDS} for r in range(2)]
    counted, formula = step_bytes(counts, model, pl.Layout(pp=2), 16, 4, pl.split(model, 2, "uniform").bounds)
    assert counted == {k: 30 for k in lesson.KINDS}
    # by hand: stage 0 sends 16 activations of 32 float32 forward, stage 1 their gradients back
    assert formula == {"pp": 2 * 16 * 32 * 4, "pp_gather": 0, "tp": 0, "dp": 0}
