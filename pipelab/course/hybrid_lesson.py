"""Lesson 08's functions: run layouts on local ranks, compare with one device, draw the bytes, a layout widget.

    rows = pl.hybrid_lesson.run_layouts(4, [(1, 2, 2), (2, 2, 1), (2, 1, 2)], kind="gpt")
    pl.hybrid_lesson.plot_bytes(rows)
    pl.hybrid_lesson.layout_widget(n_devices=16, gpus_per_node=8)

`run_layouts` launches `n_ranks` gloo ranks once; on them, for each (dp, pp, tp), one
`pl.DistributedPipeline(..., layout=)` step (after a warm-up) counted with
`count_communication()`.  Back in the caller: the loss and largest gradient difference
from the single-device step, bytes per kind summed over the ranks beside the closed forms
(`predict/comm_formulas.py`), and the parameter bytes of the fullest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import models
from ..model.partition import split
from ..model.reference import single_device_gradients
from ..predict.comm_formulas import STEP_KINDS, step_bytes
from ..predict.hybrid_costs import ModelCosts, cluster_links, predict
from ..predict.layout import Layout
from ..runtime.distributed import DistributedPipeline
from ..runtime.processes import launch

KINDS = STEP_KINDS  # the bars and columns: "pp", "pp_gather", "tp", "dp"
BATCH, MICROBATCHES = 16, 4

# the layouts of real runs: (name, GPUs, dp, pp, tp, source)
REAL_RUNS = [
    ("BLOOM-176B", 384, 8, 12, 4, "BigScience 2022, Megatron-DeepSpeed; TP inside an 8-GPU node"),
    ("Megatron-LM 1T", 3072, 6, 64, 8, "Narayanan et al. 2021, Table 1: 8-way TP per DGX A100 node"),
    ("Megatron-LM 146B", 1536, 24, 8, 8, "Narayanan et al. 2021, Table 1"),
]


def make_model(kind: str):
    if kind == "mlp":
        return models.mlp(depth=8, width=32, seed=0)
    return models.tiny_gpt(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=8, seed=0)


def _on_each_rank(shapes: list[tuple[int, int, int]], kind: str) -> list[dict]:
    found = []
    for shape in shapes:
        model = make_model(kind)
        x, y = models.sample_batch(model, BATCH, seed=1)
        pipe = DistributedPipeline(model, n_microbatches=MICROBATCHES, schedule="1f1b",
                                   loss_fn=models.default_loss(model), layout=Layout(*shape))
        pipe.step(x, y)
        for p in pipe.parameters():
            p.grad = None
        with pipe.count_communication() as counter:
            result = pipe.step(x, y)
        found.append({"loss": result.loss, "grads": pipe.gradients(), "counts": counter.totals(),
                      "parameter_bytes": pipe.parameter_bytes(), "activation_bytes": max(
                          s.bytes for s in result.trace.memory) if result.trace.memory else 0})
    return found


@dataclass
class LayoutRun:
    layout: Layout
    loss: float
    single_device_loss: float
    max_gradient_difference: float
    measured_bytes: dict  # kind -> bytes of one step, summed over the ranks
    formula_bytes: dict
    parameter_bytes_per_rank: int  # the fullest rank's
    activation_bytes_per_rank: int  # the fullest rank's peak of kept activations (bytes counted by autograd)


def run_layouts(n_ranks: int, shapes: list[tuple[int, int, int]], kind: str = "gpt",
                timeout_seconds: float = 240) -> list[LayoutRun]:
    """Each (dp, pp, tp) of `shapes` (dp·pp·tp = n_ranks) for one step on local ranks (module docstring)."""
    per_rank = launch(_on_each_rank, n_ranks, shapes, kind, timeout_seconds=timeout_seconds)
    model = make_model(kind)
    x, y = models.sample_batch(model, BATCH, seed=1)
    loss, reference = single_device_gradients(model, x, y, models.default_loss(model))
    rows = []
    for c, shape in enumerate(shapes):
        layout = Layout(*shape)
        bounds = split(make_model(kind), layout.pp, "uniform").bounds
        worst = max(float((g - reference[n]).abs().max()) for rank in per_rank for n, g in rank[c]["grads"].items())
        measured, formula = step_bytes([rank[c]["counts"] for rank in per_rank], model, layout, BATCH, MICROBATCHES,
                                       bounds)
        rows.append(LayoutRun(layout, per_rank[0][c]["loss"], loss, worst, measured, formula,
                              max(rank[c]["parameter_bytes"] for rank in per_rank),
                              max(rank[c]["activation_bytes"] for rank in per_rank)))
    return rows


def table(rows: list[LayoutRun]) -> str:
    """One line per layout: loss difference, gradient difference, bytes per kind measured / formula, memory."""
    lines = [f"{'layout':16} {'|Δloss|':>8} {'max|Δgrad|':>10} " + " ".join(f"{k + ' meas/formula':>22}" for k in KINDS)
             + f" {'params/rank':>11} {'acts/rank':>9}"]
    for row in rows:
        cells = " ".join(f"{row.measured_bytes[k]:>10,}/{row.formula_bytes[k]:<11,}" for k in KINDS)
        lines.append(f"{str(row.layout):16} {abs(row.loss - row.single_device_loss):8.1e} "
                     f"{row.max_gradient_difference:10.1e} {cells} {row.parameter_bytes_per_rank:11,} "
                     f"{row.activation_bytes_per_rank:9,}")
    return "\n".join(lines)


def plot_bytes(rows: list[LayoutRun], title: str = "bytes of one step, summed over the ranks"):
    """Bars of each kind's measured bytes side by side per layout (formula as a black tick)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(KINDS)
    for k, kind in enumerate(KINDS):
        xs = [i + (k - (len(KINDS) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r.measured_bytes[kind] for r in rows], width, label=kind)
        ax.scatter(xs, [r.formula_bytes[kind] for r in rows], marker="_", color="black", s=120, zorder=3)
    ax.set_xticks(range(len(rows)), [str(r.layout) for r in rows])
    ax.set_ylabel("bytes")
    ax.set_title(title)
    ax.legend(ncols=len(KINDS), fontsize=8)
    fig.tight_layout()
    return fig


# a GPT layer stack of h = 8192, s = 2048, one sequence per micro-batch, bf16 (for the widget)
CLUSTER_MODEL = ModelCosts(forward_seconds=0.8, backward_seconds=1.6, activation_bytes=2048 * 8192 * 2,
                           n_layers=16, parameter_bytes=2 * 16 * 12 * 8192 ** 2)


def layout_view(dp: int, tp: int, n_devices: int = 16, gpus_per_node: int = 8, inside_gbps: float = 300.0,
                between_gbps: float = 25.0, n_microbatches: int = 16, model: ModelCosts = CLUSTER_MODEL) -> str:
    """The predicted step of a layout of `n_devices` (pp = n / (dp·tp)): time, memory, bytes per kind."""
    layout = Layout.for_world(n_devices, data_parallel=dp, tensor_parallel=tp)
    links = cluster_links(layout, gpus_per_node, (5e-6, inside_gbps * 1e9), (20e-6, between_gbps * 1e9))
    found = predict(layout, model, links, n_microbatches)
    where = {dim: "inside a node" if link.bandwidth == inside_gbps * 1e9 else "between nodes"
             for dim, link in links.items()}
    lines = [f"{layout}: step {found.step_seconds:.2f} s (pipeline {found.pipeline_seconds:.2f} s + "
             f"DP all-reduce {found.dp_seconds:.2f} s)",
             f"parameters per device {found.parameter_bytes_per_device / 2**30:.2f} GiB"]
    lines += [f"  {dim}: {found.bytes_per_device[dim] / 2**30:8.2f} GiB sent per device per step, {where[dim]}"
              for dim in ("pp", "tp", "dp")]
    return "\n".join(lines)


def layout_widget(n_devices: int = 16, gpus_per_node: int = 8):
    """Sliders over dp and tp (pp follows) and the two link speeds; prints `layout_view`."""
    import ipywidgets as widgets

    divisors = [k for k in range(1, n_devices + 1) if n_devices % k == 0]
    dp = widgets.SelectionSlider(options=divisors, value=1, description="dp")
    tp = widgets.SelectionSlider(options=divisors, value=min(gpus_per_node, n_devices), description="tp")
    inside = widgets.FloatLogSlider(value=300, base=10, min=1, max=3, description="node GB/s")
    between = widgets.FloatLogSlider(value=25, base=10, min=0, max=2.5, description="net GB/s")
    out = widgets.Output()

    def show(_=None):
        out.clear_output()
        with out:
            if n_devices % (dp.value * tp.value):
                print(f"dp·tp = {dp.value * tp.value} does not divide {n_devices} devices")
            else:
                print(layout_view(dp.value, tp.value, n_devices, gpus_per_node, inside.value, between.value))

    for control in (dp, tp, inside, between):
        control.observe(show, names="value")
    show()
    return widgets.VBox([widgets.HBox([dp, tp]), widgets.HBox([inside, between]), out])


__all__ = ["KINDS", "REAL_RUNS", "LayoutRun", "layout_view", "layout_widget", "plot_bytes", "run_layouts", "table"]
