"""Lesson 08's functions: run layouts on local ranks, compare with one device, draw the bytes, a layout widget.

    rows = pl.hybrid_lesson.run_layouts(4, [(1, 2, 2), (2, 2, 1), (2, 1, 2)], kind="gpt")
    pl.hybrid_lesson.plot_bytes(rows)
    pl.hybrid_lesson.layout_widget(n_devices=16, gpus_per_node=8)

`run_layouts` launches `n_ranks` gloo ranks once; on them, for each (dp, pp, tp), one
`pl.DistributedPipeline(..., layout=)` step (after a warm-up) counted with
`count_communication()`.  Back in the caller: the loss and largest gradient difference
from the single-device step, bytes per kind summed over the ranks beside the closed forms
(`predict/comm_formulas.py`), and the parameter bytes of the fullest rank.

Beside the run: `split_linear_by_hand` (Megatron's two splits of one Linear, rank by rank in one
process), `bubble_at_fixed_batch` (the rule that picks d and p at a fixed global batch) and
`tp_over_pp_payload` (why TP stays inside a node), each with its formula and source below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..model import models
from ..model.partition import split
from ..model.reference import single_device_gradients
from ..predict.comm_formulas import STEP_KINDS, step_bytes
from ..predict.hybrid_costs import ModelCosts, cluster_links, predict
from ..predict.layout import Layout
from ..runtime.distributed import DistributedPipeline
from ..runtime.launcher.processes import launch

KINDS = STEP_KINDS  # the bars and columns: "pp", "pp_gather", "tp", "dp"
BATCH, MICROBATCHES = 16, 4


class RealRun(NamedTuple):
    """The (dp, pp, tp) layout of a published training run; dp·pp·tp = devices."""

    name: str
    devices: int  # GPUs, or TPU v4 chips for PaLM
    dp: int
    pp: int
    tp: int
    n_layers: int
    source: str


# the largest dense runs mix the kinds; PaLM is the counter-example, with no pipeline at all
REAL_RUNS = [
    RealRun("BLOOM-176B", 384, 8, 12, 4, 70, "Le Scao et al. 2022 (BLOOM): A100s, Megatron-DeepSpeed"),
    RealRun("MT-NLG 530B", 4480, 16, 35, 8, 105, "Smith et al. 2022: 8-way TP in a DGX A100 node, 280 GPUs a replica"),
    RealRun("Llama 3 405B", 16384, 128, 16, 8, 126, "Llama 3 Herd of Models 2024, Table 4: H100s, context parallel 1"),
    RealRun("PaLM 540B", 6144, 512, 1, 12, 118,
            "Chowdhery et al. 2022: TPU v4, 2 pods x (12-way model x 256-way data)"),
    RealRun("Megatron-LM 1T", 3072, 6, 64, 8, 128, "Narayanan et al. 2021, Table 1: a throughput benchmark"),
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
                      "parameter_bytes": pipe.parameter_bytes(),
                      "activation_bytes": max(result.trace.peak_memory, default=0)})
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
    activation_bytes_per_rank: int  # the fullest rank's counted peak of kept activations (saved-tensor hooks)


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


def split_linear_by_hand(tp: int = 2, batch: int = 4, in_features: int = 8, out_features: int = 8,
                         seed: int = 0) -> dict[str, float]:
    """Megatron's two splits of Y = X·A (A = weightᵀ), rank by rank in one process, against the whole Linear.

    The largest |difference| from the whole Y = X·A, or from the whole ∂X = ∂Y·Aᵀ (autograd's), of:

        "column: the slices side by side"   [X·A_0 | ... | X·A_t-1], A split by columns: no communication
        "row: one rank's partial"           X_0·A_0 alone, A split by rows: not Y yet
        "row: the partials summed"          Σ_r X_r·A_r: the sum is g, an all-reduce forward
        "column ∂X: one rank's"             ∂X from rank 0's slice alone
        "column ∂X: summed"                 Σ_r ∂X_r: the sum is f, an all-reduce backward

    (Shoeybi et al. 2019, §3; task 4.2 runs the same on 2 processes with dist.all_reduce.)
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_features, generator=generator, dtype=torch.float64)
    a = torch.randn(in_features, out_features, generator=generator, dtype=torch.float64)
    grad_y = torch.randn(batch, out_features, generator=generator, dtype=torch.float64)
    whole = x @ a
    grad_x = grad_y @ a.T
    columns, rows = a.chunk(tp, dim=1), a.chunk(tp, dim=0)
    partials = [x_r @ a_r for x_r, a_r in zip(x.chunk(tp, dim=1), rows)]
    rank_grads = []
    for a_r, grad_y_r in zip(columns, grad_y.chunk(tp, dim=1)):
        x_copy = x.clone().requires_grad_()
        (x_copy @ a_r).backward(grad_y_r)  # this rank's part of ∂X: its slice of ∂Y through its columns
        rank_grads.append(x_copy.grad)

    def worst(found, expected):
        return float((found - expected).abs().max())

    return {"column: the slices side by side": worst(torch.cat([x @ a_r for a_r in columns], dim=1), whole),
            "row: one rank's partial": worst(partials[0], whole),
            "row: the partials summed": worst(sum(partials), whole),
            "column ∂X: one rank's": worst(rank_grads[0], grad_x),
            "column ∂X: summed": worst(sum(rank_grads), grad_x)}


class FixedBatchBubble(NamedTuple):
    """What `bubble_at_fixed_batch` returns: m and the bubble written both ways."""

    n_microbatches: int  # m = B / (b·d)
    bubble_fraction: float  # idle share of the step, (p−1)/(m+p−1), as `Trace.bubble_fraction`
    bubble_over_ideal: float  # SC21's form, (p−1)/m = bubble_fraction / (1 − bubble_fraction)


def bubble_at_fixed_batch(global_batch: int, microbatch_size: int, data_parallel: int,
                          n_stages: int) -> FixedBatchBubble:
    """The pipeline bubble of GPipe / 1F1B when the global batch B is fixed (Narayanan et al. 2021, §3.3).

    Each of d replicas gets B/d samples, cut into micro-batches of b: m = B/(b·d).  With equal stages the
    idle share of the step is (p−1)/(m+p−1); SC21 writes it against the ideal time, (p−1)/m = (p−1)·b·d/B.
    On n = d·p devices that is (1 − 1/p)·n·b/B: moving devices from d to p gives each replica more
    micro-batches, never enough, and the bubble grows toward n·b/B; devices given to TP shrink d instead,
    leaving more micro-batches to each pipeline.
    """
    per_replica = microbatch_size * data_parallel
    if global_batch % per_replica:
        raise ValueError(f"a global batch of {global_batch} is not a whole number of micro-batches of "
                         f"{microbatch_size} on {data_parallel} replicas: {global_batch} / ({microbatch_size}·"
                         f"{data_parallel}) = {global_batch / per_replica:g}")
    m, p = global_batch // per_replica, n_stages
    return FixedBatchBubble(m, (p - 1) / (m + p - 1), (p - 1) / m)


def tp_over_pp_payload(n_layers: int, tp: int, pp: int) -> float:
    """Bytes handed to c10d per step by TP over those by PP's sends, summed over all ranks: 2·L·t/(p−1).

    Per micro-batch of A = b·s·h elements: TP, 4 all-reduces of A per layer (2 forward, 2 backward;
    Shoeybi et al. 2019, §3) on each of t ranks, 4·L·t·A over the pipeline; PP, at each of p−1
    boundaries t ranks send A/t forward and A/t back (Narayanan et al. 2021, §4.1), 2·(p−1)·A.
    Payload, not wire bytes: a ring all-reduce puts 2·(t−1)/t of its payload on the wire per rank.
    Infinite with no pipeline (p = 1).
    """
    return math.inf if pp == 1 else 2 * n_layers * tp / (pp - 1)


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


__all__ = ["KINDS", "REAL_RUNS", "FixedBatchBubble", "LayoutRun", "RealRun", "bubble_at_fixed_batch", "layout_view",
           "layout_widget", "plot_bytes", "run_layouts", "split_linear_by_hand", "table", "tp_over_pp_payload"]
