"""Every text a plot draws stays inside its figure, at small and large p and m and in the lessons' layouts.

The widgets show figures as PNGs of the whole figure, and a notebook crops to the figure
too when axes share it, so a label that runs past the edge is cut off for the learner.
The check records the window extent of every text artist as it is drawn (tick labels of
ticks outside the view are not drawn, so they do not count).
"""

import matplotlib.pyplot as plt
import pytest

import pipelab as pl
from pipelab.schedules.trace import MemorySample, Trace
from pipelab.show.widgets import explorer_figures, explorer_view

SIZES = [(1, 1), (2, 8), (4, 8), (8, 64), (16, 64)]  # (p, m)




def assert_texts_inside(fig, drawn, tolerance=1.0):
    drawn.clear()
    fig.canvas.draw()
    assert drawn, "nothing was drawn"
    width, height = fig.canvas.get_width_height()
    outside = [(text, tuple(round(v) for v in box.extents)) for text, box in drawn
               if box.x0 < -tolerance or box.y0 < -tolerance or box.x1 > width + tolerance
               or box.y1 > height + tolerance]
    plt.close(fig)
    assert not outside, f"text outside the {width}x{height} px figure (x0, y0, x1, y1): {outside}"


def simulated(p, m, schedule="1f1b", **costs):
    return pl.simulate(pl.schedules.by_name(schedule, p, m), pl.Costs(1.0, 2.0, memory_bytes=2**20, **costs))


def measured_like(p, m, names):
    """A trace as the engines return it: times in seconds, named devices."""
    trace = simulated(p, m)
    events = [e._replace(start=e.start * 1e-3, end=e.end * 1e-3) for e in trace.events]
    memory = [MemorySample(s.device, s.time * 1e-3, s.bytes) for s in trace.memory]
    return Trace(events, memory, "replayed", p, m, p, trace.schedule_name, device_names=names(p))


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_timeline_and_memory_fit(drawn_texts, p, m, schedule):
    trace = simulated(p, m, schedule, latency=0.2)
    assert_texts_inside(pl.plot.timeline(trace), drawn_texts)
    assert_texts_inside(pl.plot.memory(trace), drawn_texts)
    assert_texts_inside(pl.plot.memory(trace, budget_bytes=2 * 2**20), drawn_texts)
    assert_texts_inside(pl.plot.memory(trace, predicted=trace, budget_bytes=2**20), drawn_texts)


@pytest.mark.parametrize("names", [lambda p: [f"cuda:{d}" for d in range(p)],
                                   lambda p: [f"rank {d} (cpu)" for d in range(p)]], ids=["cuda", "ranks"])
@pytest.mark.parametrize("p", [2, 8])
def test_named_devices_fit(drawn_texts, names, p):
    trace = measured_like(p, 8, names)
    assert_texts_inside(pl.plot.timeline(trace), drawn_texts)
    assert_texts_inside(pl.plot.compare(simulated(p, 8), trace), drawn_texts)


@pytest.mark.parametrize("p,m", SIZES)
def test_stacked_and_compare_fit(drawn_texts, p, m):
    traces = {"predicted": simulated(p, m), "replayed": measured_like(p, m, lambda q: ["cpu"] * q)}
    assert_texts_inside(pl.plot.compare(*traces.values()), drawn_texts)
    assert_texts_inside(pl.plot.stacked({**traces, "measured": traces["replayed"]}, title="three ways"), drawn_texts)


@pytest.mark.parametrize("method", ["uniform", "params", "time"])
def test_partition_fits_alone_and_in_lesson_01s_three_rows(drawn_texts, method):
    model = pl.models.mlp(depth=8, width=16)
    x, _ = pl.models.sample_batch(model, 4)
    for n_stages in (1, 4, 8):
        assert_texts_inside(pl.plot.partition(pl.split(model, n_stages, method, sample=x, repeats=1)), drawn_texts)
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5))  # lesson 01: three splits one above the other
    for ax in axes:
        pl.plot.partition(pl.split(model, 4, method, sample=x, repeats=1), ax=ax)
    assert_texts_inside(fig, drawn_texts)


def test_figures_drawn_into_the_lessons_axes_fit(drawn_texts):
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)  # lesson 07: two timelines
    for ax, latency in zip(axes, (0.0, 1.0)):
        pl.plot.timeline(simulated(4, 8, "gpipe", latency=latency), ax=ax, title=f"latency {latency:g}")
    assert_texts_inside(fig, drawn_texts)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [1, 2.2]})  # lesson 09
    left.bar(["1", "2"], [1, 2])
    pl.plot.timeline(simulated(16, 8), ax=right, label_microbatches=False)
    assert_texts_inside(fig, drawn_texts)
    for p in (4, 16):  # lessons 04 and 05: memory side by side in given axes
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True)
        for ax in axes:
            pl.plot.memory(simulated(p, 16), ax=ax, budget_bytes=2**21, unit_bytes=1024, unit_name="KiB",
                           title=f"GPipe p={p}, m=16 (simulated)")
        assert_texts_inside(fig, drawn_texts)


@pytest.mark.parametrize("stages,max_microbatches", [((2, 4, 8, 16), 64), ((2,), 4)])
def test_bubble_plot_fits(drawn_texts, stages, max_microbatches):
    assert_texts_inside(pl.plot.bubble_vs_microbatches(stages, max_microbatches), drawn_texts)


@pytest.mark.parametrize("p,m", SIZES)
def test_the_explorers_pictures_fit(drawn_texts, p, m):
    for budget in (None, 2.0):
        for fig in explorer_figures(explorer_view(p, m, memory_budget=budget)):
            assert_texts_inside(fig, drawn_texts)


def test_the_check_catches_a_clipped_label(drawn_texts):
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.set_ylabel("a label far too long for an axes two inches high")
    with pytest.raises(AssertionError, match="text outside"):
        assert_texts_inside(fig, drawn_texts)

