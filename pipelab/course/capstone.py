"""Lesson 14's functions: plan a training run, draw the plan's best row, run it scaled down, search a schedule.

    spec, found = capstone.plan_run()                       # the defaults: a 12.9 B GPT on 64 A100-80GB
    schedule, costs = capstone.row_timeline(spec, found.best)   # simulate(...) + dp = the row's step
    capstone.scale_down(found.best.layout)                  # pp <= 2, tp <= 2, dp fills the ranks
    runs = capstone.run_scaled([(2, 1, 1), (1, 2, 1), (1, 1, 2)])   # real gloo ranks, beside predict()
    found = capstone.search_against_named(4, 8, costs, memory_limit=6)
    capstone.model_state_bytes(12.9e9, "zero-3", 8)         # ZeRO's sharding beside PP's (lesson 14, "Sharding")

`row_timeline` turns a `PlanRow` back into one micro-batch's T_F, T_B (and T_W for ZB-H1) on the
busiest stage, from the row's own `seconds` (planner.py's module docstring):

    compute = m·(C_F + C_B),  C_F : C_B = F : (2F + R)      F, R: the stage's forward and recomputed FLOPs
    tp      = m·(2 + 2·k)·(L/p)·AR                          k = 2 with full recomputation, else 1
    pp      = m·2·v·msg
    gathers = m·j·g                                         ZeRO-3's all-gathers before each computing action,
                                                            j = 2 (F, B) or 3 (ZB-H1: F, I, W); else 0
    T_F = C_F + tp·1/(2 + 2k)·1/m + pp/(2m) + g,   T_B = (compute + tp + pp + gathers)/m − T_F,
    T_W = weight_share·2·C_F + g

so that `simulate` of the named schedule on those costs, plus the row's data-parallel all-reduce,
is the row's `step_seconds` (tests/test_capstone.py checks it for every schedule).

`run_scaled` runs a tiny GPT (4 layers of width 128, 16 sequences of 32 tokens, 4 micro-batches, 1F1B)
on local gloo ranks for each layout, beside `hybrid_costs.predict` fed with what was measured here:
one micro-batch's forward and backward on one thread, and a ping-pong between two ranks (the link's
latency and bandwidth).  The step measured is the slowest rank's `wall_seconds`, the fastest of
`repeats` steps after a warm-up; the gradients are compared with the single-device step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch

from ..model import models
from ..model.reference import single_device_gradients
from ..predict.costs import Costs
from ..predict.hybrid_costs import Link, ModelCosts, predict
from ..predict.layout import Layout
from ..predict.planner import Plan, PlanRow, plan
from ..predict.schedule_search import search_schedule
from ..predict.simulate import simulate
from ..predict.transformer_memory import TransformerSpec
from ..runtime.distributed import DistributedPipeline
from ..runtime.launcher.processes import launch
from ..schedules import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1
from ..schedules.action import Action, Kind
from ..schedules.schedule import Schedule
from ..show import plot

GIB = 2**30
# A 12.9 B GPT (40 layers of 5120 with 40 heads: GPT-3 13B's depth and heads at Megatron-LM's width; the GPT-3
# paper's Table 2.1 prints 5140) on 8 DGX A100 nodes (SC21's cluster, planner.py)
DEFAULTS = {"layers": 40, "hidden": 5120, "heads": 40, "seq": 2048, "vocab": 51200, "n_devices": 64,
            "devices_per_node": 8, "memory_gib": 80.0, "inside_gb_per_s": 300.0, "between_gb_per_s": 25.0,
            "global_batch": 512}
# the widget's models: name -> (layers, hidden, heads), sequences of 2048 tokens, 51,200 words (GPT-3's shapes)
MODELS = {"1.3 B (24 × 2048)": (24, 2048, 16), "12.9 B (40 × 5120)": (40, 5120, 40),
          "39 B (48 × 8192)": (48, 8192, 64), "175 B (96 × 12288)": (96, 12288, 96)}
PEAK_FLOPS = 312e12  # A100 bf16
LINK_LATENCY = {"inside": 5e-6, "between": 10e-6}  # seconds per message, the planner's SC21 assumption


def plan_run(layers: int = 40, hidden: int = 5120, heads: int = 40, seq: int = 2048, vocab: int = 51200,
             n_devices: int = 64, devices_per_node: int = 8, memory_gib: float = 80.0,
             inside_gb_per_s: float = 300.0, between_gb_per_s: float = 25.0,
             global_batch: int = 512) -> tuple[TransformerSpec, Plan]:
    """`pl.plan` in the widget's units (GiB per device, GB/s per link), A100 peak FLOP/s at half achieved."""
    spec = TransformerSpec(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    found = plan(spec, n_devices, devices_per_node, memory_gib * GIB, global_batch,
                 inside=(LINK_LATENCY["inside"], inside_gb_per_s * 1e9),
                 between=(LINK_LATENCY["between"], between_gb_per_s * 1e9), peak_flops_per_second=PEAK_FLOPS)
    return spec, found


def row_timeline(spec: TransformerSpec, row: PlanRow, weight_share: float = 0.5) -> tuple:
    """(schedule, costs): the row's schedule and one micro-batch's times on its busiest stage (module
    docstring); `simulate(schedule, costs).makespan + row.seconds["dp"]` is `row.step_seconds`.  Each
    micro-batch weighs its activation bytes on that stage (`costs.memory_bytes`), so the trace's memory
    is the row's activations, less full recomputation's one rebuilt layer."""
    _, p, _ = row.layout.shape
    m, v, b = row.n_microbatches, row.chunks, row.micro_batch_size
    layers = math.ceil(spec.layers / p)
    flops = layers * spec.layer_forward_flops(b) + spec.logits_forward_flops(b)
    again = {"none": 0.0, "selective": layers * spec.attention_core_flops(b),
             "full": layers * spec.layer_forward_flops(b)}[row.recompute]
    k = 2 if row.recompute == "full" else 1
    compute_forward = row.seconds["compute"] / m * flops / (3 * flops + again)
    gather = row.seconds["dp_gather"] / (m * (3 if row.schedule == "zb-h1" else 2))  # g: 0 unless ZeRO-3
    forward = compute_forward + row.seconds["tp"] / m / (1 + k) + row.seconds["pp"] / (2 * m) + gather
    backward = (row.seconds["compute"] + row.seconds["tp"] + row.seconds["pp"] + row.seconds["dp_gather"]) / m - forward
    kept = layers * spec.layer_activation_bytes(b, row.layout.tp, row.recompute)
    if row.schedule == "zb-h1":
        weight = weight_share * 2 * compute_forward + gather
        return zero_bubble_h1(p, m), Costs(forward=forward, backward=backward - weight, weight=weight,
                                          memory_bytes=kept)
    if row.schedule == "interleaved":
        return interleaved_1f1b(p, m, v), Costs(forward=forward / v, backward=backward / v, memory_bytes=kept / v)
    return {"gpipe": gpipe, "1f1b": one_f_one_b}[row.schedule](p, m), Costs(forward=forward, backward=backward,
                                                                             memory_bytes=kept)


def show_plan(spec: TransformerSpec, found: Plan, n_rows: int = 6):
    """The ranked table, then the best row's predicted timeline and each of the top layouts' memory per
    device (parameters, gradients, optimizer, activations) against the limit.  Returns the best row."""
    print(found.table(n_rows))
    best = found.best
    if best is None:
        print("nothing fits: more devices, more memory per device, or a smaller model")
        return None
    schedule, costs = row_timeline(spec, best)
    trace = simulate(schedule, costs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 3.2), gridspec_kw={"width_ratios": [2, 1]})
    plot.timeline(trace, ax=left, title=f"#1 {best.layout}, {best.schedule_name}: one pipeline, predicted "
                  f"({trace.makespan:.2f} s + {best.seconds['dp']:.2f} s all-reduce)", label_microbatches=False)
    rows = found.by_layout()[:n_rows]
    parts = ("parameters", "gradients", "optimizer", "activations")
    bottom = [0.0] * len(rows)
    for part in parts:
        heights = [getattr(r.memory, part) / GIB for r in rows]
        right.bar(range(len(rows)), heights, bottom=bottom, label=part)
        bottom = [a + h for a, h in zip(bottom, heights)]
    right.axhline(found.memory_bytes / GIB, color="k", linestyle="--", label="limit")
    right.set_xticks(range(len(rows)), [f"#{k + 1}\n{r.layout.dp}·{r.layout.pp}·{r.layout.tp}"
                                        for k, r in enumerate(rows)])
    right.set_ylabel("GiB per device")
    right.set_title("memory of the top layouts (dp·pp·tp)")
    right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return best


# the state of mixed-precision Adam, bytes a parameter: 2 (fp16 weights) + 2 (fp16 gradients) + 12 (fp32 weights,
# momentum, variance), ZeRO §3
STATE_BYTES = {"parameters": 2, "gradients": 2, "optimizer": 12}
SHARDING = ("whole", "pp", "zero-1", "zero-2", "zero-3")


def model_state_bytes(parameters: float, how: str = "whole", devices: int = 1) -> float:
    """Bytes of model state (parameters, gradients, optimizer state) one device holds (Rajbhandari et al. 2020,
    ZeRO, §5 and Figure 1), Ψ parameters at 2 + 2 + 12 bytes (`STATE_BYTES`), n devices:

        "whole"    16Ψ             every data-parallel replica keeps all of it (the planner's assumption)
        "pp"       16Ψ/n           a pipeline of n equal stages (or n-way tensor parallelism)
        "zero-1"   4Ψ + 12Ψ/n      n data-parallel ranks shard the optimizer state (P_os)
        "zero-2"   2Ψ + 14Ψ/n      ... and the gradients (P_os+g)
        "zero-3"   16Ψ/n           ... and the parameters (P_os+g+p; PyTorch's FSDP)
    """
    if how not in SHARDING:
        raise ValueError(f"how must be one of {', '.join(SHARDING)}, got {how!r}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    p, g, o = (STATE_BYTES[k] * parameters for k in ("parameters", "gradients", "optimizer"))
    return {"whole": p + g + o, "pp": (p + g + o) / devices, "zero-1": p + g + o / devices,
            "zero-2": p + (g + o) / devices, "zero-3": (p + g + o) / devices}[how]


def sharding_table(specs: dict[str, TransformerSpec], devices: int = 8) -> str:
    """GiB of model state a device holds, per model: whole, a pipeline of n stages, ZeRO-1, -2 and -3 on n ranks."""
    heads = ("whole", f"PP p = {devices}", f"ZeRO-1 d = {devices}", f"ZeRO-2 d = {devices}",
             f"ZeRO-3/FSDP d = {devices}")
    lines = [f"{'model':20} {'parameters':>10}" + "".join(f"{h:>19}" for h in heads) + "   (GiB a device)"]
    for name, spec in specs.items():
        cells = "".join(f"{model_state_bytes(spec.parameters, how, devices) / GIB:19.1f}" for how in SHARDING)
        lines.append(f"{name:20} {spec.parameters / 1e9:9.2f}B" + cells)
    return "\n".join(lines)


def scale_down(layout: Layout, n_ranks: int = 2) -> Layout:
    """The layout mapped onto `n_ranks` local ranks (2 or 4): pp and tp kept if 1, else 2 (pipelining first
    when 2 ranks cannot hold both), data parallelism fills what is left."""
    if n_ranks not in (2, 4):
        raise ValueError(f"n_ranks must be 2 or 4, got {n_ranks!r}")
    pp, tp = min(layout.pp, 2), min(layout.tp, 2)
    if pp * tp > n_ranks:
        tp = 1
    return Layout(dp=n_ranks // (pp * tp), pp=pp, tp=tp)


MICRO_BATCHES, BATCH = 4, 16


def scaled_model():
    """The run's tiny GPT: 4 layers of width 128, 4 heads, 256 tokens, sequences of 32."""
    return models.tiny_gpt(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=32, seed=0)


def _ping(n_values: int, repeats: int = 6) -> float:
    """Half the fastest round trip of n float32 values between ranks 0 and 1 (every rank calls it)."""
    dist = torch.distributed
    rank, buffer, best = dist.get_rank(), torch.zeros(n_values), math.inf
    for _ in range(repeats):
        dist.barrier()
        begin = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        best = min(best, (time.perf_counter() - begin) / 2)
    return best


def _on_each_rank(shapes: list[tuple[int, int, int]], repeats: int) -> dict:
    small, large = _ping(1), _ping(2**20)  # 4 bytes, 4 MiB
    runs = []
    for shape in shapes:
        model = scaled_model()
        x, y = models.sample_batch(model, BATCH, seed=1)
        pipe = DistributedPipeline(model, n_microbatches=MICRO_BATCHES, schedule="1f1b",
                                   loss_fn=models.default_loss(model), layout=Layout(*shape))
        walls = []
        for _ in range(repeats + 1):  # the first is a warm-up
            for q in pipe.parameters():
                q.grad = None
            torch.distributed.barrier()
            result = pipe.step(x, y)
            walls.append(result.wall_seconds)
        runs.append({"walls": walls[1:], "grads": pipe.gradients(), "loss": result.loss})
    return {"ping": (small, large), "runs": runs}


@dataclass
class ScaledRun:
    layout: Layout
    predicted_seconds: float
    measured_seconds: float  # the fastest of the repeats, each the slowest rank's wall time
    max_gradient_difference: float  # from the single-device step
    loss: float
    single_device_loss: float

    @property
    def error(self) -> float:
        """(measured − predicted) / measured."""
        return (self.measured_seconds - self.predicted_seconds) / self.measured_seconds


def measure_one_device(repeats: int = 5) -> ModelCosts:
    """The scaled model's one micro-batch, forward and backward, on one thread here (median of `repeats`)."""
    from .applications import time_one_microbatch
    model = scaled_model()
    x, y = models.sample_batch(model, BATCH // MICRO_BATCHES, seed=1)
    forward, backward = time_one_microbatch(model, x, y, models.default_loss(model), repeats=repeats)
    return ModelCosts(forward_seconds=forward, backward_seconds=backward,
                      activation_bytes=BATCH // MICRO_BATCHES * 32 * 128 * 4, n_layers=4,
                      parameter_bytes=sum(q.numel() * q.element_size() for q in model.parameters()))


def run_scaled(shapes: list[tuple[int, int, int]], repeats: int = 3,
               timeout_seconds: float = 240) -> tuple[list[ScaledRun], Link]:
    """Each (dp, pp, tp) of `shapes` (all on the same number of ranks) for real, beside its prediction
    (module docstring).  Returns the runs and the link measured between two ranks."""
    n_ranks = Layout(*shapes[0]).world_size
    if any(Layout(*s).world_size != n_ranks for s in shapes):
        raise ValueError(f"every layout must use the same number of ranks, got {shapes}")
    costs = measure_one_device()
    per_rank = launch(_on_each_rank, n_ranks, shapes, repeats, timeout_seconds=timeout_seconds)
    small, large = per_rank[0]["ping"]
    link = Link(latency=small, bandwidth=4 * 2**20 / max(large - small, 1e-9))
    model = scaled_model()
    x, y = models.sample_batch(model, BATCH, seed=1)
    loss, reference = single_device_gradients(model, x, y, models.default_loss(model))
    runs = []
    for c, shape in enumerate(shapes):
        layout = Layout(*shape)
        predicted = predict(layout, costs, {"tp": link, "pp": link, "dp": link}, MICRO_BATCHES).step_seconds
        measured = min(max(rank["runs"][c]["walls"][k] for rank in per_rank) for k in range(repeats))
        worst = max(float((g - reference[n]).abs().max()) for rank in per_rank
                    for n, g in rank["runs"][c]["grads"].items())
        runs.append(ScaledRun(layout, predicted, measured, worst, per_rank[0]["runs"][c]["loss"], float(loss)))
    return runs, link


def scaled_table(runs: list[ScaledRun]) -> str:
    lines = [f"{'layout':18} {'predicted ms':>12} {'measured ms':>11} {'error':>7} {'max|Δgrad|':>10}"]
    lines += [f"{r.layout!s:18} {r.predicted_seconds * 1e3:12.1f} {r.measured_seconds * 1e3:11.1f} "
              f"{r.error:7.0%} {r.max_gradient_difference:10.1e}" for r in runs]
    return "\n".join(lines)


NAMED = ("gpipe", "1f1b", "zb-h1")


def named_schedule(name: str, n_stages: int, n_microbatches: int):
    """A named schedule as the search enters it (docs/schedule_search.md): ZB-H1 as is, GPipe and 1F1B with
    each whole backward B run as its two halves back to back, I then W (the same timing and memory)."""
    if name == "zb-h1":
        return zero_bubble_h1(n_stages, n_microbatches)
    named = {"gpipe": gpipe, "1f1b": one_f_one_b}[name](n_stages, n_microbatches)
    rows = [[half for a in row for half in ((Action(Kind.I, a.stage, a.microbatch), Action(Kind.W, a.stage,
                                                                                          a.microbatch))
                                            if a.kind is Kind.B else (a,))] for row in named.actions]
    return Schedule(n_stages, n_microbatches, rows, name=named.name)


@dataclass
class SearchResult:
    found: object  # the Schedule the search returned
    traces: dict  # name -> Trace: "search", then the named schedules
    fits: dict  # name -> whether its peak memory is within the limit
    memory_limit: float

    @property
    def best_named(self) -> str | None:
        fitting = [name for name in NAMED if self.fits[name]]
        return min(fitting, key=lambda name: self.traces[name].makespan) if fitting else None

    @property
    def gain(self) -> float | None:
        """How much shorter the search's step is than the best named one that fits (None: none fits)."""
        if self.best_named is None:
            return None
        return 1 - self.traces["search"].makespan / self.traces[self.best_named].makespan


def search_against_named(n_stages: int, n_microbatches: int, costs: Costs, memory_limit: float) -> SearchResult:
    """`search_schedule` under `memory_limit`, and GPipe, 1F1B and ZB-H1 simulated on the same work, with
    whether each fits (its peak memory, the unit of `costs.memory_bytes`; `costs.weight` > 0: a split backward)."""
    found = search_schedule(n_stages, n_microbatches, costs, memory_limit=memory_limit)
    traces = {"search": simulate(found, found.meta["costs"])}
    for name in NAMED:
        traces[name] = simulate(named_schedule(name, n_stages, n_microbatches), found.meta["costs"])
    fits = {name: max(trace.peak_memory) <= memory_limit + 1e-9 for name, trace in traces.items()}
    return SearchResult(found, traces, fits, memory_limit)


def search_by_limit(n_stages: int, n_microbatches: int, costs: Costs, limits) -> dict:
    """{limit: SearchResult} for each memory limit."""
    return {limit: search_against_named(n_stages, n_microbatches, costs, limit) for limit in limits}


def plot_search_by_limit(by_limit: dict, ax=None, title: str = ""):
    """The search's step and each named schedule's, against the memory limit (a named one only where it fits)."""
    ax = ax or plt.gca()
    limits = list(by_limit)
    for name in ("search", *NAMED):
        points = [(limit, r.traces[name].makespan) for limit, r in by_limit.items() if r.fits[name]]
        if points:
            ax.plot(*zip(*points), marker="o", label=name, linestyle="-" if name == "search" else "--")
    ax.set_xticks(limits)
    ax.set_xlabel("memory limit, micro-batches per device")
    ax.set_ylabel("step (simulated)")
    ax.set_title(title)
    ax.legend()
    return ax
