"""The timeline shows every action, idle time, and says where its times came from."""

import matplotlib.colors as mcolors
import numpy as np
import pytest
import torch

import pipelab as pl
from pipelab.schedules.trace import Event, MemorySample, Trace


def two_device_trace(source="replayed"):
    events = [Event("F", 0, 0, 0.0, 1.0, 0), Event("F", 1, 0, 1.0, 2.0, 1),
              Event("B", 1, 0, 2.0, 4.0, 1), Event("B", 0, 0, 4.0, 6.0, 0)]
    memory = [MemorySample(0, 1.0, 100), MemorySample(0, 6.0, 0), MemorySample(1, 2.0, 50), MemorySample(1, 4.0, 0)]
    return Trace(events, memory, source, 2, 1, 2, "gpipe")


def bar_spans(ax, color):
    """(device row, start, width) of every rectangle drawn in `color`."""
    found = []
    for patch in ax.patches:
        if tuple(patch.get_facecolor()[:3]) == mcolors.to_rgb(color):
            for polygon in patch.get_path().to_polygons():
                (x0, y0), (x1, y1) = polygon.min(axis=0), polygon.max(axis=0)
                found.append((round((y0 + y1) / 2), round(x0, 6), round(x1 - x0, 6)))
    return sorted(found)


def test_timeline_draws_each_action_in_its_row_and_colour():
    trace = two_device_trace()
    ax = pl.plot.timeline(trace).axes[0]
    # times are drawn in ms for a measured (replayed) trace: F0 on device 0 at 0..1 s = 0..1000 ms
    assert bar_spans(ax, pl.plot.COLORS["F"]) == [(0, 0.0, 1000.0), (1, 1000.0, 1000.0)]
    assert bar_spans(ax, pl.plot.COLORS["B"]) == [(0, 4000.0, 2000.0), (1, 2000.0, 2000.0)]
    assert bar_spans(ax, pl.plot.IDLE) == [(0, 0.0, 6000.0), (1, 0.0, 6000.0)]  # idle shows behind the gaps
    assert [t.get_text() for t in ax.get_yticklabels()] == ["device 0", "device 1"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # device 0 on top
    title = ax.get_title()
    assert "replayed" in title and "bubble 50.0%" in title  # busy 3 + 3 of 2 x 6
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "backward", "idle (bubble)"]


def test_a_devices_second_chunk_is_drawn_in_its_own_shade():
    """Interleaved 1F1B, p = 2, v = 2: device 0 runs stages 0 and 2; stage 2's forwards are the darker shade,
    at exactly the times the trace gives them, and the legend says what the shade means."""
    trace = pl.simulate(pl.schedules.interleaved_1f1b(2, 2, 2))
    ax = pl.plot.timeline(trace).axes[0]

    def spans(stages):  # a simulated trace is drawn in cost-model units, as it is
        return sorted((e.device, round(e.start, 6), round(e.duration, 6))
                      for e in trace.events if e.kind == "F" and e.stage in stages)
    darker = pl.plot.chunk_shade(pl.plot.COLORS["F"], 1)
    assert bar_spans(ax, pl.plot.COLORS["F"]) == spans({0, 1})
    assert bar_spans(ax, darker) == spans({2, 3})
    assert darker != mcolors.to_rgb(pl.plot.COLORS["F"])
    assert "darker: a device's 2nd stage (chunk)" in [t.get_text() for t in ax.get_legend().get_texts()]
    plain = pl.plot.timeline(pl.simulate(pl.schedules.one_f_one_b(2, 2))).axes[0]
    assert not any("chunk" in t.get_text() for t in plain.get_legend().get_texts())


def test_timeline_title_says_simulated():
    assert "simulated" in pl.plot.timeline(two_device_trace("simulated")).axes[0].get_title()


def test_memory_plot_marks_peaks():
    ax = pl.plot.memory(two_device_trace()).axes[0]
    assert "peak" in ax.get_legend().get_texts()[0].get_text()


def test_plots_refuse_non_traces():
    with pytest.raises(TypeError, match="Trace"):
        pl.plot.timeline([1, 2])
    with pytest.raises(TypeError, match="Trace"):
        pl.plot.memory(None)


def test_partition_plot_colours_each_stage_and_names_the_heaviest():
    model = pl.models.mlp(depth=6, width=8)
    parts = pl.split(model, 3, "params")
    ax = pl.plot.partition(parts).axes[0]
    assert len(ax.patches) == 6
    assert len({p.get_facecolor() for p in ax.patches}) == 3
    assert "heaviest is stage" in ax.get_title()
    with pytest.raises(TypeError, match="pl.split"):
        pl.plot.partition(model)


def test_compare_stacks_two_traces_on_one_axis():
    predicted, measured = two_device_trace("simulated"), two_device_trace("replayed")
    fig = pl.plot.compare(predicted, measured)
    top, bottom = fig.axes
    assert top.get_title().startswith("predicted") and bottom.get_title().startswith("measured")
    assert top.get_xlim() == bottom.get_xlim()
    with pytest.raises(TypeError, match="two pipelab Traces"):
        pl.plot.compare(predicted, None)


def test_stacked_draws_any_number_of_traces_on_one_axis_with_one_legend():
    traces = {"predicted": two_device_trace("simulated"), "replayed": two_device_trace("replayed"),
              "measured": two_device_trace("replayed")}
    fig = pl.plot.stacked(traces, title="three ways")
    axes = fig.axes
    assert len(axes) == 3 and [ax.get_legend() is not None for ax in axes] == [False, False, True]
    assert axes[0].get_xlim() == axes[2].get_xlim()
    assert axes[0].get_title().startswith("predicted — simulated")
    assert axes[1].get_title().startswith("measured op times")  # label = source: said once
    with pytest.raises(TypeError, match="label -> pipelab Trace"):
        pl.plot.stacked({"x": "not a trace"})


def test_bubble_plot_draws_formula_lines_and_simulated_points():
    ax = pl.plot.bubble_vs_microbatches(stages=(2, 4), max_microbatches=8).axes[0]
    lines = ax.get_lines()
    formula = [l for l in lines if l.get_linestyle() == "-" and len(l.get_xdata()) == 8]
    points = [l for l in lines if l.get_marker() == "o"]
    assert len(formula) == 2 and len(points) == 2
    for line, dots in zip(formula, points):  # the simulated dots sit on the formula
        for m, bubble in zip(dots.get_xdata(), dots.get_ydata()):
            assert bubble == pytest.approx(line.get_ydata()[int(m) - 1])


def test_memory_plot_side_by_side_and_budget():
    measured, predicted = two_device_trace(), two_device_trace("simulated")
    fig = pl.plot.memory(measured, predicted=predicted, budget_bytes=60)
    left, right = fig.axes
    assert left.get_title().startswith("predicted") and right.get_title().startswith("counted")
    assert "out of memory on device 0" in right.get_title()  # device 0 peaks at 100 bytes > 60
    assert any(line.get_linestyle() == "--" for line in right.get_lines())
    assert "out of memory" not in pl.plot.memory(measured, budget_bytes=1000).axes[0].get_title()


@pytest.mark.parametrize("n", [1, 4, 10, 11, 16, 20, 21, 64])
def test_distinct_colors_never_repeat(n):
    colors = pl.plot.distinct_colors(n)
    assert len(colors) == n and len(set(colors)) == n


def test_memory_plot_as_lines_gives_sixteen_devices_sixteen_colours():
    trace = pl.simulate(pl.schedules.one_f_one_b(16, 32), pl.Costs(memory_bytes=1.0))
    lines = pl.plot.memory(trace, heatmap=False).axes[0].get_lines()
    assert len(lines) == 16 and len({line.get_color() for line in lines}) == 16


def heatmap_rows(ax):
    """The heat-map's image and its values, one row per device."""
    (image,) = ax.images
    return image, np.asarray(image.get_array())


def test_memory_beyond_eight_devices_is_a_heatmap_of_devices_by_time():
    p, m = 16, 32
    trace = pl.simulate(pl.schedules.one_f_one_b(p, m), pl.Costs(memory_bytes=1.0))
    fig = pl.plot.memory(trace, unit_bytes=1.0, unit_name="micro-batches")
    ax = fig.axes[0]
    assert not ax.get_lines() and ax.get_ylim()[0] > ax.get_ylim()[1]  # no tangle of lines; device 0 on top
    image, values = heatmap_rows(ax)
    assert values.shape[0] == p
    # 1F1B keeps at most min(p - s, m) micro-batches on stage s (PipeDream-Flush; DESIGN.md)
    assert list(values.max(axis=1)) == [min(p - s, m) for s in range(p)]
    assert image.norm.vmax == p  # the scale ends at the highest peak
    assert "highest peak 16 micro-batches, on device 0" in ax.get_title()
    assert fig.axes[1].get_ylabel() == "activation memory (micro-batches)"  # the colour bar
    eight = pl.simulate(pl.schedules.one_f_one_b(8, m), pl.Costs(memory_bytes=1.0))
    assert len(pl.plot.memory(eight).axes[0].get_lines()) == 8  # up to 8 devices: lines


def test_heatmap_columns_follow_the_memory_curves_exactly():
    trace = two_device_trace()  # device 0 holds 100 bytes over [1, 6) s, device 1 50 bytes over [2, 4) s
    ax = pl.plot.memory(trace, heatmap=True, unit_bytes=1.0, unit_name="bytes").axes[0]
    image, values = heatmap_rows(ax)
    assert list(image.get_extent()[:2]) == [0.0, 6000.0]  # ms
    # columns [0, 1), [1, 2), [2, 4), [4, 6) s: every change of either curve is a column edge
    assert values.tolist() == [[0, 100, 100, 100], [0, 0, 50, 0]]


def test_heatmap_shows_a_budget_as_the_end_of_its_scale_and_more_in_red():
    trace = pl.simulate(pl.schedules.gpipe(12, 16), pl.Costs(memory_bytes=1.0))
    fig = pl.plot.memory(trace, budget_bytes=8, unit_bytes=1.0, unit_name="micro-batches")
    image, _ = heatmap_rows(fig.axes[0])
    assert image.norm.vmax == 8 and mcolors.to_hex(image.cmap.get_over()) == mcolors.to_hex("crimson")
    assert "out of memory on devices 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11" in fig.axes[0].get_title()


def test_titles_count_in_the_singular_and_the_plural():
    one = pl.plot.timeline(pl.simulate(pl.schedules.gpipe(1, 1), pl.Costs())).axes[0].get_title()
    assert "p=1 stage, m=1 micro-batch —" in one and " of 1 device x " in one
    many = pl.plot.timeline(pl.simulate(pl.schedules.gpipe(2, 3), pl.Costs())).axes[0].get_title()
    assert "p=2 stages, m=3 micro-batches —" in many and " of 2 devices x " in many
    model = pl.models.mlp(depth=2, width=4)
    assert "into 1 stage:" in pl.plot.partition(pl.split(model, 1)).axes[0].get_title()
    assert pl.plot.counted(1, "micro-batch") == "1 micro-batch" and pl.plot.counted(0, "device") == "0 devices"


def test_memory_plot_draws_the_observed_curve_of_an_engine_step():
    model = pl.models.mlp(depth=4, width=16, seed=0)
    x, y = pl.models.sample_batch(model, batch_size=8)
    trace = pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss(),
                        devices="cpu").step(x, y).trace
    observed, counted = trace.peak_memory_observed, trace.peak_memory
    assert observed != counted  # else the test could not tell the curves apart
    for what, peaks in (("observed", observed), ("counted", counted)):
        ax = pl.plot.memory(trace, what=what, unit_bytes=1, unit_name="B").axes[0]
        assert what in ax.get_title() or (what == "counted" and "kept for backward" in ax.get_title())
        tops = [max(line.get_ydata()) for line in ax.get_lines() if line.get_linestyle() != "--"]
        assert tops == pytest.approx(peaks)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"device {d}: peak {peaks[d]:.3g}" for d in (0, 1)]
    fig = pl.plot.memory(trace, predicted=pl.simulate(pl.schedules.one_f_one_b(2, 4), pl.Costs(1.0, 2.0)),
                         what="observed")
    assert fig.axes[1].get_title().startswith("observed")
    with pytest.raises(ValueError, match="no 'observed' memory samples"):
        pl.plot.memory(pl.simulate(pl.schedules.gpipe(2, 2), pl.Costs(1.0, 2.0)), what="observed")
    with pytest.raises(ValueError, match="memory samples are one of"):
        pl.plot.memory(trace, what="measured")
