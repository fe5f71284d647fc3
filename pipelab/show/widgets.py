"""The explorer: drag the number of devices and micro-batches and watch the bubble change.

The widget layer only wires controls to plain, tested functions: `explorer_view` (simulate
+ formula) and `run_for_real` (the local engine on the CPU beside its prediction).  Its
schedule menu (`SCHEDULES`) holds GPipe, 1F1B, interleaved 1F1B (with a chunks slider v),
ZB-H1 (with the share of the backward that is W) and asynchronous PipeDream (with the weight
versions each stage holds).
"""

from __future__ import annotations

import dataclasses
import functools
import html
from dataclasses import dataclass

import torch

from ..common.gc_pause import gc_paused
from ..model import models
from ..predict.closed_forms import closed_form
from ..predict.costs import Costs
from ..predict.simulate import simulate
from ..runtime.local import Pipeline
from ..schedules import by_name, interleaved_1f1b
from ..schedules.action import Action, Kind
from ..schedules.pipedream import versions_in_flight, weight_versions
from ..schedules.schedule import Schedule
from ..schedules.trace import Trace
from . import plot
from .plot_style import devices_named
from .throttle import Throttle

REAL_RUN_LIMITS = {"n_devices": 8, "n_microbatches": 16}

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "pipedream-async")
"""The explorer's schedule menu."""

READS = {"interleaved-1f1b": ("n_chunks", "v={}"), "zb-h1": ("weight_share", "t_W share {:g}")}
"""The schedules that read one more slider: its name (an `explorer_view` argument and a control),
and how a real run's label shows its value.  The others ignore both sliders (disabled for them)."""


# Memory in the explorer is counted in units of one micro-batch's activations on one stage;
# a stage's input (all that checkpointing keeps) is a fraction of that.
INPUT_SHARE = 0.125


@dataclass
class ExplorerView:
    trace: Trace
    formula_bubble: float | None  # the schedule's closed form (no communication); None where it does not hold
    memory_budget: float | None = None  # per device, in micro-batch activation units
    inputs: tuple = ()  # explorer_view's arguments, the memory budget last: what the pictures depend on
    formula_text: str = "(p-1)/(m+p-1)"  # the closed form's text (predict/closed_forms.py, with its source)
    weight_versions: list[int] | None = None  # asynchronous PipeDream: versions each stage holds at most
    last_versions: list[int] | None = None  # ... and the version each stage's F of the last micro-batch used

    @property
    def out_of_memory(self) -> list[int]:
        """Devices whose peak activation memory exceeds the budget."""
        if not self.memory_budget:
            return []
        return [d for d, peak in enumerate(self.trace.peak_memory) if peak > self.memory_budget * UNIT]

    @property
    def summary(self) -> str:
        t = self.trace
        peak = t.peak_memory[0] / UNIT
        formula = (f"formula {self.formula_text} = {self.formula_bubble:.1%}" if self.formula_bubble is not None
                   else f"formula {self.formula_text}")
        text = (f"{t.schedule_name}: p={t.n_devices}, m={t.n_microbatches} — simulated bubble "
                f"{t.bubble_fraction:.1%}, {formula}; "
                f"peak activations on device 0: {peak:.3g} micro-batch{'' if peak == 1 else 'es'}")
        if self.weight_versions is not None:
            text += (f"; weight versions held per stage: {self.weight_versions} (p - s in the steady state), micro-batch "
                     f"{t.n_microbatches - 1} ran with versions {self.last_versions} on stages 0..{t.n_stages - 1}")
        if self.out_of_memory:
            text += f" — OUT OF MEMORY on {devices_named(self.out_of_memory)}"
        return text


UNIT = 1000  # bytes standing for one micro-batch's activations on one stage


def explorer_schedule(schedule: str, n_devices: int, n_microbatches: int, n_chunks: int = 2) -> Schedule:
    """The menu's `schedule` for p devices and m micro-batches (interleaved: `n_chunks` per device)."""
    if schedule == "interleaved-1f1b":
        return interleaved_1f1b(n_devices, n_microbatches, n_chunks)
    return by_name(schedule, n_devices, n_microbatches)


def explorer_costs(schedule: str, backward_ratio: float, latency: float, n_chunks: int,
                   weight_share: float) -> Costs:
    """t_F = 1 and t_B = `backward_ratio` per stage; an interleaved chunk costs 1/v of that and keeps
    1/v of a stage's activations (its input is a whole activation); ZB-H1's W is `weight_share` of t_B."""
    if schedule == "interleaved-1f1b":
        return Costs(forward=1.0 / n_chunks, backward=backward_ratio / n_chunks, latency=latency,
                     memory_bytes=UNIT / n_chunks, input_bytes=min(INPUT_SHARE * UNIT, UNIT / n_chunks))
    split = weight_share if schedule == "zb-h1" else 0.0
    return Costs(forward=1.0, backward=backward_ratio * (1 - split), weight=backward_ratio * split, latency=latency,
                 memory_bytes=UNIT, input_bytes=INPUT_SHARE * UNIT)


def explorer_formula(schedule: str, p: int, m: int, costs: Costs, n_chunks: int) -> tuple[float | None, str]:
    """(bubble fraction, its formula as text) at the costs, without communication: the schedule's
    closed form (`pipelab.predict.closed_forms`, where each formula is given with its source); the
    fraction None, and the text saying where it holds, outside the form's domain (ZB-H1: m < p or
    t_W > t_F, t_B)."""
    form = closed_form(schedule, p, m, costs, n_chunks)
    if not form.exact:
        return None, f"{form.bubble_text} holds only for {form.condition}"
    return form.bubble_fraction, form.bubble_text


def explorer_view(n_devices: int, n_microbatches: int, schedule: str = "1f1b", backward_ratio: float = 2.0,
                  latency: float = 0.0, checkpoint: str = "never", memory_budget: float | None = None,
                  n_chunks: int = 2, weight_share: float = 0.5) -> ExplorerView:
    """Simulate one step with t_F = 1, t_B = `backward_ratio`, `latency` per message (in units of t_F).

    Memory: each micro-batch holds one unit of activations per stage (UNIT bytes), a stage
    input INPUT_SHARE of that; `memory_budget` (units per device, None or 0 = no budget)
    flags the devices that would run out of memory.  "interleaved-1f1b" cuts the model into
    `n_chunks` chunks per device (m must be a multiple of p: a ValueError says which m works);
    "zb-h1" splits the backward into B and W, W taking `weight_share` of t_B; "pipedream-async"
    adds the weight versions of PipeDream's stashing (`pl.pipedream`).
    """
    table = explorer_schedule(schedule, n_devices, n_microbatches, n_chunks)
    costs = explorer_costs(schedule, backward_ratio, latency, n_chunks, weight_share)
    trace = simulate(table, costs, checkpoint=checkpoint)
    formula, formula_text = explorer_formula(schedule, n_devices, n_microbatches, costs, n_chunks)
    read = READS.get(schedule)
    shaping = {"n_chunks": n_chunks, "weight_share": weight_share}[read[0]] if read else None
    inputs = (n_devices, n_microbatches, schedule, backward_ratio, latency, checkpoint, shaping, memory_budget or None)
    view = ExplorerView(trace, formula, memory_budget, inputs, formula_text)
    if table.asynchronous:
        used = weight_versions(table)
        view.weight_versions = versions_in_flight(table)
        view.last_versions = [used[Action("F", s, n_microbatches - 1)] for s in range(table.n_stages)]
    return view


def explorer_figures(view: ExplorerView):
    """The explorer's two pictures of a view as new figures, one at a time: its timeline, then its
    activation memory (in micro-batch units).  The widget draws the same into figures it keeps
    (`ExplorerPanels`)."""
    yield plot.timeline(view.trace)
    budget = view.memory_budget
    yield plot.memory(view.trace, budget_bytes=budget * UNIT if budget else None, unit_bytes=UNIT,
                      unit_name="micro-batches")


class ExplorerPanels:
    """The explorer's two pictures, drawn into two figures kept for the widget's life.

    A new matplotlib figure costs as much as drawing it (axes, 16 y ticks, spines), so each
    picture only empties its axes and draws the view anew; what stays while p does (the
    device names, the legend) is drawn once and pasted under the rest (`_Backdrop`); the
    pixels are encoded once.  At p=16, m=64 that is about 60 ms of CPU for a change of m
    and 85 ms for a change of p, against 150 ms for new figures (benchmarks/simulator.py).
    The last `cached` pictures are remembered by the values they depend on, so one the
    sliders already showed (dragging back, or a budget change, which leaves the timeline
    as it was) costs nothing.
    """

    def __init__(self, cached: int = 32):
        self.cached = cached  # pictures remembered (0: none, as a benchmark of the drawing wants)
        self.timeline_figure, self.timeline_axes = _kept_figure()
        self.memory_figure, self.memory_axes = _kept_figure()
        self.memory_heatmap, self.colorbar = None, None
        self.timeline_backdrop, self.memory_backdrop = _Backdrop(self.timeline_figure), _Backdrop(self.memory_figure)
        self.cache: dict[tuple, bytes] = {}

    def pictures(self, view: ExplorerView) -> tuple[bytes, bytes]:
        """(timeline, memory) PNGs of `view`."""
        return self.timeline(view), self.memory(view)

    def timeline(self, view: ExplorerView) -> bytes:
        return self._cached(("timeline", *view.inputs[:-1]), lambda: self._draw_timeline(view))

    def memory(self, view: ExplorerView) -> bytes:
        return self._cached(("memory", *view.inputs), lambda: self._draw_memory(view))

    def _cached(self, key: tuple, draw) -> bytes:
        if key in self.cache:
            return self.cache[key]
        png = draw()
        if self.cached:
            if len(self.cache) >= self.cached:
                del self.cache[next(iter(self.cache))]  # the oldest
            self.cache[key] = png
        return png

    def _draw_timeline(self, view: ExplorerView) -> bytes:
        ax, trace = self.timeline_axes, view.trace
        _empty(ax)
        plot.fit_timeline(self.timeline_figure, trace)
        plot.draw_timeline(ax, trace)
        # the device names and the legend stay while only m, t_B or the latency change
        legend = tuple(text.get_text() for text in ax.legend_.get_texts())
        key = (trace.n_devices, tuple(trace.device_names), legend)
        self.timeline_backdrop.draw(key, unchanging=[ax.yaxis, ax.legend_])
        _pin_labels(ax)
        return _encode(self.timeline_figure)

    def _draw_memory(self, view: ExplorerView) -> bytes:
        fig, ax = self.memory_figure, self.memory_axes
        heatmap = view.trace.n_devices >= plot.HEATMAP_FROM
        if heatmap != self.memory_heatmap:  # lines <-> heat-map: start from new axes
            for old in fig.axes:
                old.remove()
            self.memory_axes = ax = fig.add_subplot()
            self.memory_heatmap, self.colorbar = heatmap, None
            self.memory_backdrop = _Backdrop(fig)
        _empty(ax)
        plot.fit_memory(fig, heatmap)
        budget = view.memory_budget * UNIT if view.memory_budget else None
        image = plot.draw_memory(ax, view.trace, budget_bytes=budget, unit_bytes=UNIT, unit_name="micro-batches",
                                 heatmap=heatmap, legend_outside=True)
        if image is not None:
            self.colorbar = plot.colorbar(fig, image, "micro-batches", budget, self.colorbar)
        # a heat-map's device numbers stay while p does; lines change their axes and legend with every view
        key = ("heatmap", view.trace.n_devices, self.colorbar.extend) if heatmap else None
        self.memory_backdrop.draw(key, unchanging=[ax.yaxis])
        _pin_labels(ax)
        return _encode(fig)


class _Backdrop:
    """What a kept figure shows unchanged from one picture to the next (a timeline's device names
    and legend: a third of its drawing), drawn once per `key` and pasted under the rest.

    The rest are drawn over it in the order a full draw uses (by z-order; the artists that
    stay lie outside the data area, so nothing drawn later would have covered them); the
    pictures are the same pixels as a full draw (tested).  `key` None: draw everything.
    """

    def __init__(self, figure):
        self.figure, self.key, self.pixels = figure, None, None

    def draw(self, key, unchanging: list) -> None:
        canvas, (ax, *other_axes) = self.figure.canvas, self.figure.axes
        if key is None:
            self.key = None
            canvas.draw()
            return
        changing = [a for a in ax.get_children() if a is not ax.patch and all(a is not u for u in unchanging)]
        if key != self.key:
            for artist in changing + other_axes:
                artist.set_visible(False)
            canvas.draw()
            self.pixels, self.key = canvas.copy_from_bbox(self.figure.bbox), key
            for artist in changing + other_axes:
                artist.set_visible(True)
        canvas.restore_region(self.pixels)
        for artist in sorted(changing, key=lambda a: a.get_zorder()) + other_axes:  # sorted() is stable
            self.figure.draw_artist(artist)


def _kept_figure():
    """A figure outside pyplot (no notebook backend shows or keeps it), drawn by Agg, with one axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(dpi=DPI)
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _pin_labels(ax) -> None:
    """Keep the x label where the draw just put it, and an empty y label (the timeline's) too.  Left
    to itself matplotlib measures every tick label again at each draw to place a label, even an
    empty one; the panels keep their bottom margin (in inches) and their tick labels' height, so
    the x label's place does not change."""
    for axis in (ax.xaxis, ax.yaxis):
        label = axis.label
        if axis is ax.xaxis or not label.get_text():
            axis.set_label_coords(*label.get_position(), transform=label.get_transform())


def _empty(ax) -> None:
    """Remove what a picture drew on `ax` (lines, patches, texts, images, collections, legend), keep the axes."""
    for artist in [*ax.lines, *ax.patches, *ax.texts, *ax.images, *ax.collections, *ax.artists]:
        artist.remove()
    if ax.legend_ is not None:
        ax.legend_.remove()
    ax.ignore_existing_data_limits = True  # autoscaling forgets the removed lines


DPI = 80


def _encode(fig) -> bytes:
    """Encode the pixels `fig` was last drawn to, once, as a PNG of 256 colours (fastest zlib level).

    A slider waits on it: reduced to a palette (Pillow's fast octree), the picture looks
    the same, encodes in 2/3 of the time and is a third the size to send to the browser.
    """
    import io

    from PIL import Image

    width, height = fig.canvas.get_width_height(physical=True)
    rgba = Image.frombuffer("RGBA", (width, height), fig.canvas.buffer_rgba(), "raw", "RGBA", 0, 1)  # no copy
    pixels = rgba.convert("RGB")  # the quantizer reads RGB: an RGBA palette would add a transparency chunk
    buffer = io.BytesIO()
    pixels.quantize(256, method=Image.Quantize.FASTOCTREE).save(buffer, format="png", compress_level=1)
    return buffer.getvalue()


def explorer_pictures(view: ExplorerView, panels: ExplorerPanels | None = None):
    """The explorer's pictures of `view` as PNG bytes, one at a time (timeline, then memory): exactly
    what a slider change computes, drawn into `panels` (new ones if not given)."""
    panels = panels or ExplorerPanels()
    for draw in (panels.timeline, panels.memory):
        with gc_paused(collect_young=True):  # see pipelab.common.gc_pause: a picture is a burst of allocations
            png = draw(view)
        yield png


def _png(fig) -> bytes:
    """A new pyplot figure as PNG bytes, then closed."""
    import matplotlib.pyplot as plt

    fig.set_dpi(DPI)
    fig.canvas.draw()
    png = _encode(fig)
    plt.close(fig)
    return png


def run_for_real(n_devices: int, n_microbatches: int, schedule: str = "1f1b", width: int = 256,
                 samples_per_microbatch: int = 16, seed: int = 0, n_chunks: int = 2,
                 weight_share: float = 0.5) -> tuple[Trace, Trace]:
    """Run the MLP for real on the CPU and predict the same step from profiled costs.

    Returns (predicted, measured).  Kept small (p <= 8, m <= 16) so it answers in seconds.
    Interleaved: p·`n_chunks` stages of the MLP on p devices.  ZB-H1 runs its W actions; the
    profile measures whole backwards, so the prediction gives W `weight_share` of each.
    Asynchronous PipeDream runs as one PipeDream run of m minibatches (plain SGD per stage, its
    update inside each B, which the profile does not time).
    """
    if n_devices > REAL_RUN_LIMITS["n_devices"] or n_microbatches > REAL_RUN_LIMITS["n_microbatches"]:
        raise ValueError(f"a real run on the CPU is limited to p <= {REAL_RUN_LIMITS['n_devices']} and "
                         f"m <= {REAL_RUN_LIMITS['n_microbatches']}; the simulator has no limit")
    table = explorer_schedule(schedule, n_devices, n_microbatches, n_chunks)
    model = models.mlp(depth=max(8, table.n_stages), width=width, seed=seed)
    inputs, targets = models.sample_batch(model, n_microbatches * samples_per_microbatch, seed=seed)
    loss_fn = torch.nn.MSELoss()
    optimizer = (lambda params: torch.optim.SGD(params, lr=0.01)) if table.asynchronous else None
    pipe = Pipeline(model, n_stages=table.n_stages, n_microbatches=n_microbatches, schedule=table, loss_fn=loss_fn,
                    devices="cpu", optimizer=optimizer)
    pipe.step(inputs, targets)  # warm-up
    model.zero_grad(set_to_none=True)
    measured = pipe.step(inputs, targets).trace
    one_microbatch = (inputs[:samples_per_microbatch], targets[:samples_per_microbatch])
    costs = Costs.from_profile(model, pipe.partition, one_microbatch, loss_fn, repeats=3)
    if Kind.I in table.gradient_kind:  # the profile timed whole backwards: share them between I and W
        costs = dataclasses.replace(costs, backward=[b * (1 - weight_share) for b in costs.backward],
                                    weight=[b * weight_share for b in costs.backward])
    return simulate(pipe.schedule, costs), measured


@functools.cache
def _explorer_box():
    """The explorer's VBox class (made on first use: ipywidgets loads only with the first widget)."""
    import ipywidgets as w

    class ExplorerBox(w.VBox):
        """A VBox whose `view` is the simulation of the controls' current values, made when asked for."""

        _view: ExplorerView | None = None

        @property
        def view(self) -> ExplorerView:
            if self._view is None:
                self._view = explorer_view(**{name: c.value for name, c in self.controls.items()})
            return self._view

        def forget_view(self) -> None:
            self._view = None

    return ExplorerBox


def explorer(n_devices: int = 4, n_microbatches: int = 8, schedule: str = "1f1b"):
    """The interactive dashboard (JupyterLab): sliders, the timeline, the bubble against the formula.

    Returns an `ipywidgets.VBox`; `box.controls` holds the controls (devices, micro-batches,
    schedule, t_B/t_F, latency, checkpoint, memory budget in micro-batch units, 0 = none,
    chunks per device v for interleaved 1F1B, the share of the backward that is W for ZB-H1;
    each of the last two is disabled while another schedule is chosen),
    `box.view` the `ExplorerView` of their current values (simulated when first read after a
    change: a drag sends many values and only the drawn ones need one), `box.real` the latest
    (predicted, measured) pair of a real run and `box.real_for` its (p, m, schedule; with v or
    the W share for the schedules that read them): the
    comparison is hidden, and said to be out of date, while the sliders show other values.
    The summary and pictures are redrawn through `box.pictures`, a `Throttle`: a drag shows
    a picture every redraw (+ 40 ms) and always ends on the last values.
    """
    import ipywidgets as w

    labelled = dict(style={"description_width": "initial"})  # show the whole label, not "micro-bat..."
    controls = {
        "n_devices": w.IntSlider(value=n_devices, min=1, max=16, description="devices p", **labelled),
        "n_microbatches": w.IntSlider(value=n_microbatches, min=1, max=64, description="micro-batches m", **labelled),
        "schedule": w.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule", **labelled),
        "backward_ratio": w.FloatSlider(value=2.0, min=0.5, max=4.0, step=0.25, description="t_B / t_F", **labelled),
        "latency": w.FloatSlider(value=0.0, min=0.0, max=2.0, step=0.1, description="latency / t_F", **labelled),
        "checkpoint": w.Dropdown(options=["never", "always", "except_last"], value="never",
                                 description="checkpointing", **labelled),
        "memory_budget": w.FloatSlider(value=0.0, min=0.0, max=64.0, step=0.5,
                                       description="budget (micro-batches)", **labelled),
        "n_chunks": w.IntSlider(value=2, min=1, max=4, description="interleaved chunks v", **labelled),
        "weight_share": w.FloatSlider(value=0.5, min=0.0, max=0.9, step=0.05,
                                      description="t_W share of the backward (zb-h1)", **labelled),
    }
    button = w.Button(description="run it for real (CPU)", icon="play", layout=w.Layout(width="auto"))
    summary, real_message = w.HTML(), w.HTML()
    timeline_image, memory_image, real_image = (w.Image(format="png") for _ in range(3))
    box = _explorer_box()([w.HBox([controls["n_devices"], controls["n_microbatches"], controls["schedule"]]),
                           w.HBox([controls["backward_ratio"], controls["latency"], button]),
                           w.VBox([w.HBox([controls["checkpoint"], controls["memory_budget"]]),
                                   w.HBox([controls["n_chunks"], controls["weight_share"]])]),
                           summary, timeline_image, memory_image, real_message, real_image])
    box.controls, box.real, box.real_for = controls, None, None
    real_image.layout.display = "none"  # until there is a real run to show
    panels = ExplorerPanels()

    def pictures():
        try:
            view = box.view
        except ValueError as error:  # values no schedule fits (interleaving with m not a multiple of p)
            summary.value = f"<b>{html.escape(str(error))}</b>"
            for image in (timeline_image, memory_image):
                image.layout.display = "none"  # pictures of other values would pass for these
            return
        try:
            summary.value = f"<b>{html.escape(view.summary)}</b>"
            for image, png in zip((timeline_image, memory_image), explorer_pictures(view, panels)):
                image.value = png  # a picture of our own: no dependence on the notebook's plot backend
                image.layout.display = None
        except Exception as error:  # a booked draw runs outside any cell: say what went wrong here
            summary.value = f"<b>could not draw the pictures: {html.escape(repr(error))}</b>"
            raise

    box.pictures = Throttle(pictures)

    def update(_=None):  # cheap: a drag sends many values; the throttled draw simulates the latest
        box.forget_view()
        read = READS.get(controls["schedule"].value, ("",))[0]
        for name, _ in READS.values():  # the sliders only one schedule reads
            controls[name].disabled = name != read
        show_real_run()
        box.pictures()

    def real_key() -> tuple:
        """(p, m, schedule) of the sliders, the schedule with what else a real run of it depends on."""
        schedule = controls["schedule"].value
        if schedule in READS:
            name, shown = READS[schedule]
            schedule += f" ({shown.format(controls[name].value)})"
        return controls["n_devices"].value, controls["n_microbatches"].value, schedule

    def show_real_run():
        if box.real_for is None:
            return
        p, m, schedule = box.real_for
        current = real_key()
        if current == box.real_for:
            real_message.value = f"<b>run for real, {schedule}, p={p}, m={m}: predicted (above) and measured (below), one time axis</b>"
            real_image.layout.display = None
        else:  # a picture of other values would pass for these: hide it, say whose it was
            real_message.value = (f"<i>the real run was for p={p}, m={m}, {schedule} (out of date, hidden): "
                                  f"press \u201c{button.description}\u201d for the sliders' values</i>")
            real_image.layout.display = "none"

    def real(_=None):
        real_message.value = "<i>running the engine on the CPU…</i>"
        key = real_key()
        try:
            box.real = run_for_real(key[0], key[1], controls["schedule"].value, n_chunks=controls["n_chunks"].value,
                                    weight_share=controls["weight_share"].value)
        except ValueError as error:
            real_message.value = f"<b>{html.escape(str(error))}</b>"
            real_image.layout.display = "none"
            return
        box.real_for = key
        real_image.value = _png(plot.compare(*box.real))
        show_real_run()

    for control in controls.values():
        control.observe(update, names="value")
    button.on_click(real)
    update()
    return box
