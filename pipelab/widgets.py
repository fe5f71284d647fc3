"""The explorer: drag the number of devices and micro-batches and watch the bubble change.

The widget layer only wires controls to plain, tested functions: `explorer_view` (simulate
+ formula) and `run_for_real` (the local engine on the CPU beside its prediction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .costs import Costs
from .gc_pause import gc_paused
from .schedules import GENERATORS, by_name
from .simulate import simulate
from .trace import Trace

REAL_RUN_LIMITS = {"n_devices": 8, "n_microbatches": 16}


# Memory in the explorer is counted in units of one micro-batch's activations on one stage;
# a stage's input (all that checkpointing keeps) is a fraction of that.
INPUT_SHARE = 0.125


@dataclass
class ExplorerView:
    trace: Trace
    formula_bubble: float  # (p-1)/(m+p-1): GPipe §2.3, Megatron-LM SC21 §2.2.1 (no communication)
    memory_budget: float | None = None  # per device, in micro-batch activation units

    @property
    def out_of_memory(self) -> list[int]:
        """Devices whose peak activation memory exceeds the budget."""
        if not self.memory_budget:
            return []
        return [d for d, peak in enumerate(self.trace.peak_memory) if peak > self.memory_budget * UNIT]

    @property
    def summary(self) -> str:
        t = self.trace
        text = (f"{t.schedule_name}: p={t.n_stages}, m={t.n_microbatches} — simulated bubble "
                f"{t.bubble_fraction:.1%}, formula (p-1)/(m+p-1) = {self.formula_bubble:.1%}; "
                f"peak activations on device 0: {t.peak_memory[0] / UNIT:.3g} micro-batches")
        if self.out_of_memory:
            text += f" — OUT OF MEMORY on device(s) {self.out_of_memory}"
        return text


UNIT = 1000  # bytes standing for one micro-batch's activations on one stage


def explorer_view(n_devices: int, n_microbatches: int, schedule: str = "1f1b", backward_ratio: float = 2.0,
                  latency: float = 0.0, checkpoint: str = "never", memory_budget: float | None = None) -> ExplorerView:
    """Simulate one step with t_F = 1, t_B = `backward_ratio`, `latency` per message (in units of t_F).

    Memory: each micro-batch holds one unit of activations per stage (UNIT bytes), a stage
    input INPUT_SHARE of that; `memory_budget` (units per device, None or 0 = no budget)
    flags the devices that would run out of memory.
    """
    trace = simulate(by_name(schedule, n_devices, n_microbatches),
                     Costs(forward=1.0, backward=backward_ratio, latency=latency, memory_bytes=UNIT,
                           input_bytes=INPUT_SHARE * UNIT), checkpoint=checkpoint)
    return ExplorerView(trace, (n_devices - 1) / (n_microbatches + n_devices - 1), memory_budget)


def explorer_figures(view: ExplorerView):
    """The explorer's two pictures of a view, made one at a time: its timeline, then its
    activation memory (in micro-batch units)."""
    from . import plot

    yield plot.timeline(view.trace)
    budget = view.memory_budget
    yield plot.memory(view.trace, budget_bytes=budget * UNIT if budget else None, unit_bytes=UNIT,
                      unit_name="micro-batches")


def explorer_pictures(view: ExplorerView):
    """`explorer_figures` as PNG bytes, one at a time: exactly what a slider change computes."""
    figures = explorer_figures(view)
    while True:
        with gc_paused(collect_young=True):  # see pipelab.gc_pause: a figure is a burst of allocations
            fig = next(figures, None)
            if fig is None:
                return
            png = _png(fig)
        yield png


def _png(fig) -> bytes:
    """The figure as PNG bytes, then closed."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, pil_kwargs={"compress_level": 1})  # fast to encode: a slider waits on it
    plt.close(fig)
    return buffer.getvalue()


def run_for_real(n_devices: int, n_microbatches: int, schedule: str = "1f1b", width: int = 256,
                 samples_per_microbatch: int = 16, seed: int = 0) -> tuple[Trace, Trace]:
    """Run the MLP for real on the CPU and predict the same step from profiled costs.

    Returns (predicted, measured).  Kept small (p <= 8, m <= 16) so it answers in seconds.
    """
    import pipelab as pl

    if n_devices > REAL_RUN_LIMITS["n_devices"] or n_microbatches > REAL_RUN_LIMITS["n_microbatches"]:
        raise ValueError(f"a real run on the CPU is limited to p <= {REAL_RUN_LIMITS['n_devices']} and "
                         f"m <= {REAL_RUN_LIMITS['n_microbatches']}; the simulator has no limit")
    model = pl.models.mlp(depth=max(8, n_devices), width=width, seed=seed)
    inputs, targets = pl.models.sample_batch(model, n_microbatches * samples_per_microbatch, seed=seed)
    loss_fn = torch.nn.MSELoss()
    pipe = pl.Pipeline(model, n_devices, n_microbatches, schedule, loss_fn, devices="cpu")
    pipe.step(inputs, targets)  # warm-up
    model.zero_grad(set_to_none=True)
    measured = pipe.step(inputs, targets).trace
    one_microbatch = (inputs[:samples_per_microbatch], targets[:samples_per_microbatch])
    costs = Costs.from_profile(model, pipe.partition, one_microbatch, loss_fn, repeats=3)
    return simulate(pipe.schedule, costs), measured


def explorer(n_devices: int = 4, n_microbatches: int = 8, schedule: str = "1f1b"):
    """The interactive dashboard (JupyterLab): sliders, the timeline, the bubble against the formula.

    Returns an `ipywidgets.VBox`; `box.controls` holds the controls (devices, micro-batches,
    schedule, t_B/t_F, latency, checkpoint, memory budget in micro-batch units, 0 = none),
    `box.view` the latest `ExplorerView` and `box.real` the latest (predicted, measured)
    pair of a real run.
    """
    import ipywidgets as w

    from . import plot

    labelled = dict(style={"description_width": "initial"})  # show the whole label, not "micro-bat..."
    controls = {
        "n_devices": w.IntSlider(value=n_devices, min=1, max=16, description="devices p", **labelled),
        "n_microbatches": w.IntSlider(value=n_microbatches, min=1, max=64, description="micro-batches m", **labelled),
        "schedule": w.Dropdown(options=sorted(GENERATORS), value=schedule, description="schedule", **labelled),
        "backward_ratio": w.FloatSlider(value=2.0, min=0.5, max=4.0, step=0.25, description="t_B / t_F", **labelled),
        "latency": w.FloatSlider(value=0.0, min=0.0, max=2.0, step=0.1, description="latency / t_F", **labelled),
        "checkpoint": w.Dropdown(options=["never", "always", "except_last"], value="never",
                                 description="checkpointing", **labelled),
        "memory_budget": w.FloatSlider(value=0.0, min=0.0, max=64.0, step=0.5,
                                       description="budget (micro-batches)", **labelled),
    }
    button = w.Button(description="run it for real (CPU)", icon="play", layout=w.Layout(width="auto"))
    summary, real_message = w.HTML(), w.HTML()
    timeline_image, memory_image, real_image = (w.Image(format="png") for _ in range(3))
    box = w.VBox([w.HBox([controls["n_devices"], controls["n_microbatches"], controls["schedule"]]),
                  w.HBox([controls["backward_ratio"], controls["latency"], button]),
                  w.HBox([controls["checkpoint"], controls["memory_budget"]]),
                  summary, timeline_image, memory_image, real_message, real_image])
    box.controls, box.real = controls, None
    real_image.layout.display = "none"  # until there is a real run to show

    def redraw(_=None):
        box.view = explorer_view(**{name: c.value for name, c in controls.items()})
        summary.value = f"<b>{box.view.summary}</b>"
        for image, png in zip((timeline_image, memory_image), explorer_pictures(box.view)):
            image.value = png  # a picture of our own: no dependence on the notebook's plot backend

    def real(_=None):
        real_message.value = "<i>running the engine on the CPU…</i>"
        try:
            box.real = run_for_real(controls["n_devices"].value, controls["n_microbatches"].value,
                                    controls["schedule"].value)
        except ValueError as error:
            real_message.value = f"<b>{error}</b>"
            real_image.layout.display = "none"
            return
        real_message.value = "<b>predicted (above) and measured (below), one time axis</b>"
        real_image.value = _png(plot.compare(*box.real))
        real_image.layout.display = None

    for control in controls.values():
        control.observe(redraw, names="value")
    button.on_click(real)
    redraw()
    return box
