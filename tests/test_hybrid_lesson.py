"""Lesson 08's functions (pipelab/course/hybrid_lesson.py) beside what they are built on, and its
picture (pipelab/show/tensor_parallel_picture.py).

`run_layouts` itself runs in the lesson under nbval (its engine is tested in tests/test_hybrid.py)."""

import math

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

import pipelab as pl
import pipelab.course.hybrid_lesson as lesson
from pipelab.predict.comm_formulas import step_bytes
from pipelab.predict.hybrid_costs import cluster_links, predict
from pipelab.show.tensor_parallel_picture import TITLES, draw_tensor_parallel


def test_real_runs_multiply_to_their_devices():
    assert all(run.dp * run.pp * run.tp == run.devices for run in lesson.REAL_RUNS)
    assert [run.pp for run in lesson.REAL_RUNS if run.name.startswith("PaLM")] == [1]  # PaLM used no pipeline


@pytest.mark.parametrize("global_batch,microbatch_size,dp,pp", [
    (512, 1, 64, 1), (512, 1, 8, 8), (512, 1, 1, 64), (512, 4, 16, 4), (96, 2, 3, 5), (8, 1, 1, 8)])
def test_bubble_at_fixed_batch_is_the_simulated_bubble(global_batch, microbatch_size, dp, pp):
    found = lesson.bubble_at_fixed_batch(global_batch, microbatch_size, dp, pp)
    m = global_batch // (microbatch_size * dp)
    assert type(found.n_microbatches) is int and found.n_microbatches == m
    assert found.bubble_over_ideal == (pp - 1) * microbatch_size * dp / global_batch  # SC21 §3.3
    assert math.isclose(found.bubble_fraction / (1 - found.bubble_fraction), found.bubble_over_ideal, abs_tol=1e-12)
    for schedule in (pl.schedules.one_f_one_b(pp, m), pl.schedules.gpipe(pp, m)):
        simulated = pl.simulate(schedule, pl.Costs(forward=1.0, backward=2.0)).bubble_fraction
        assert math.isclose(simulated, found.bubble_fraction, abs_tol=1e-12)


def test_bubble_at_fixed_batch_grows_as_devices_move_from_dp_to_pp():
    bubbles = [lesson.bubble_at_fixed_batch(512, 1, 64 // pp, pp).bubble_fraction for pp in (1, 2, 4, 8, 16, 32, 64)]
    assert bubbles[0] == 0 and bubbles == sorted(bubbles) and len(set(bubbles)) == len(bubbles)


def test_bubble_at_fixed_batch_refuses_a_batch_that_does_not_divide():
    with pytest.raises(ValueError, match=r"500 / \(1·8\) = 62.5"):
        lesson.bubble_at_fixed_batch(500, 1, 8, 2)


@pytest.mark.parametrize("shape", [(1, 2, 2), (1, 3, 2), (1, 2, 4), (2, 2, 2)])
def test_tp_over_pp_payload_is_the_closed_forms_ratio(shape):
    model, layout = lesson.make_model("gpt"), pl.Layout(*shape)
    zeros = [{k: {"bytes": 0} for k in lesson.KINDS}] * layout.world_size
    _, formula = step_bytes(zeros, model, layout, lesson.BATCH, lesson.MICROBATCHES,
                            pl.split(model, layout.pp, "uniform").bounds)
    n_layers = sum(isinstance(block, pl.models.TransformerBlock) for block in model)
    assert formula["tp"] / formula["pp"] == lesson.tp_over_pp_payload(n_layers, layout.tp, layout.pp)
    assert lesson.tp_over_pp_payload(n_layers, 8, 1) == math.inf


def test_split_linear_by_hand_sums_where_megatron_all_reduces():
    for tp in (2, 4):
        found = lesson.split_linear_by_hand(tp=tp, in_features=8, out_features=12)
        assert max(found["column: the slices side by side"], found["row: the partials summed"],
                   found["column ∂X: summed"]) < 1e-12
        assert found["row: one rank's partial"] > 0.1 and found["column ∂X: one rank's"] > 0.1


def test_the_tensor_parallel_picture_has_its_three_panels_and_labels(drawn_texts):
    drawn = drawn_texts
    fig = draw_tensor_parallel()
    assert isinstance(fig, Figure)
    assert [ax.get_title() for ax in fig.axes] == list(TITLES)
    assert TITLES[0].startswith("column-parallel") and TITLES[1].startswith("row-parallel")
    fig.canvas.draw()
    texts = [text for text, _ in drawn]
    for ax, wanted in zip(fig.axes, (["f", "$A_0$", "$A_1$", "$Y_0$", "$Y_1$"], ["g", "$X_0 A_0$", "$X_1 A_1$", "$Y$"],
                                     ["all-gather", "send $Y_0$ (1/t)", "send $Y_1$ (1/t)"])):
        assert set(wanted) <= {t.get_text() for t in ax.texts}
    assert any("all-reduce" in t and "backward" in t for t in texts if t.startswith("f:"))
    assert any("all-reduce forward" in t for t in texts if t.startswith("g:"))
    assert sum(isinstance(patch, Rectangle) for patch in fig.axes[0].patches) == 5  # X, A_0, A_1, Y_0, Y_1
    width, height = fig.canvas.get_width_height()
    outside = [text for text, box in drawn if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1]
    plt.close(fig)
    assert not outside, f"text outside the figure: {outside}"


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
