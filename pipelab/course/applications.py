"""Lesson 13's functions: the five uses of pipeline parallelism the course text names, each as a run.

    by_depth = state_by_depth(model, (1, 2, 4, 8), n_microbatches=8, sample=(x, y), loss_fn=nn.MSELoss())
    state_by_depth(gpt, (1, 2), 4, (x_mb, y_mb), lm_loss, "adamw", split_method="params")  # the engine's check
    fewest_stages(by_depth, limit_bytes=80e9)          # the smallest p whose fullest device fits
    plain_losses(model, x, y, steps=20, optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    held_bytes(pipe, result.trace, "adamw")         # each device's model state + observed activations
    median_seconds(result.trace, "B")                 # each stage's median B: a frozen first stage's is ~0
    side_by_side({"m = 1": naive, "m = 4": pipe}, x, y, repeats=5)   # the same steps, in turn
    inference_points(n_stages=4, stage_seconds=0.01, microbatch_counts=(1, 2, 4, 8, 16), link_seconds=0.0)
    exit_times(trace)                                 # when each micro-batch leaves the last stage: its latency
    median_replay([pipe.infer(x).trace for _ in range(5)], pl.schedules.inference(4, 8))
    greedy_text(gpt, prompts, new_tokens=16)          # the single device's text, no cache
    predict_two_hosts(two_hosts_model(forward_seconds, backward_seconds), bits_per_second=1e8)

Sources of the formulas: ZeRO (Rajbhandari et al., SC20, §3.1) for 16 bytes of model state per
parameter under mixed-precision Adam (`pl.device_memory`, predict/budget.py); GPipe's fill-drain
arithmetic without the backward for inference (schedules/inference.py); the ring all-reduce and
Megatron's TP all-reduces for the two hosts (predict/hybrid_costs.py).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..common.threads import intra_op_threads
from ..model.partition import split
from ..predict.budget import DeviceMemory, device_memory
from ..predict.costs import Costs
from ..predict.hybrid_costs import Link, ModelCosts, Prediction, predict
from ..predict.layout import Layout
from ..predict.simulate import simulate
from ..schedules import by_name
from ..schedules.inference import inference
from ..schedules.schedule import Schedule
from ..schedules.trace import Trace

PARTS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes")


# ---------------------------------------------------------------------------------------- 1. large models
def state_by_depth(model: nn.Sequential, depths: Sequence[int], n_microbatches: int, sample: tuple | None = None,
                   loss_fn: Callable | None = None, optimizer: str = "adam", schedule: str = "1f1b",
                   split_method: str = "uniform") -> dict[int, list[DeviceMemory]]:
    """p -> every device's `DeviceMemory` for `model` split into p stages (`split_method`) under `schedule`.

    `sample`: one micro-batch (inputs, targets), profiled on each split for the activations a micro-batch
    keeps (`Costs.from_profile`); None: model state only (a model on the meta device has no data to run).
    With the first micro-batch as `sample`, these are the needs `pl.Pipeline(..., memory_limit_bytes=...)`
    checks before its first step (runtime/placement.py), without building a pipeline or running one.
    """
    found = {}
    for p in depths:
        parts = split(model, p, method=split_method)
        costs = None if sample is None else Costs.from_profile(model, parts, sample, loss_fn, repeats=1)
        found[p] = device_memory(parts, by_name(schedule, p, n_microbatches), costs, optimizer=optimizer)
    return found


def fullest(needs: list[DeviceMemory]) -> DeviceMemory:
    """The device that needs the most bytes (the one a memory limit meets first)."""
    return max(needs, key=lambda n: n.total_bytes)


def fewest_stages(by_depth: dict[int, list[DeviceMemory]], limit_bytes: float) -> int | None:
    """The smallest p of `by_depth` whose fullest device needs at most `limit_bytes`; None if none does."""
    fits = [p for p, needs in by_depth.items() if fullest(needs).total_bytes <= limit_bytes]
    return min(fits, default=None)


def plot_state_by_depth(by_depth: dict[int, list[DeviceMemory]], ax=None, title: str = "", unit: float = 2**20,
                        unit_name: str = "MiB", limit_bytes: float | None = None, limit_label: str = "one device"):
    """Stacked bars, one per p: the fullest device's parameters, gradients, optimizer state, activations;
    `limit_bytes`, a dashed line named `limit_label`."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.2))
    depths = list(by_depth)
    bottom = [0.0] * len(depths)
    for part in PARTS:
        heights = [(getattr(fullest(by_depth[p]), part) or 0) / unit for p in depths]
        ax.bar([str(p) for p in depths], heights, bottom=bottom, label=part.removesuffix("_bytes"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    if limit_bytes is not None:
        ax.axhline(limit_bytes / unit, color="black", linestyle="--", linewidth=1, label=limit_label)
    ax.set(xlabel="stages p", ylabel=f"{unit_name} on the fullest device", title=title)
    ax.legend(fontsize=8)
    return ax


# ------------------------------------------------------------------------------- 2. limited GPUs, fine-tuning
def held_bytes(pipe, trace: Trace, optimizer: str = "adamw") -> list[int]:
    """Each device's bytes in `trace`'s step: its model state as `pl.device_memory` counts it (its parameters;
    gradients and `optimizer`'s state for those that require grad, so a frozen stage holds its parameters only)
    plus the activations observed at its peak (`trace.peak_memory_observed`)."""
    state = device_memory(pipe.partition, pipe.schedule, None, optimizer)
    return [s.model_state_bytes + a for s, a in zip(state, trace.peak_memory_observed)]


def median_seconds(trace: Trace, kind: str) -> list[float]:
    """Per stage, the median duration of its `kind` actions in `trace` ("F", "B", "W", ...); 0.0 where it ran none.
    A frozen first stage's B: nothing in it requires grad, so autograd has no graph to walk there."""
    found = [[] for _ in range(trace.n_stages)]
    for e in trace.events:
        if e.kind == kind:
            found[e.stage].append(e.duration)
    return [statistics.median(d) if d else 0.0 for d in found]


class SideBySide(NamedTuple):
    """`side_by_side`'s finding for one pipeline."""

    losses: list[float]  # every repeat's loss (the same batch, the same weights: equal to rounding)
    trace: Trace  # the repeat whose makespan is the median
    makespans: list[float]  # every repeat's, seconds

    @property
    def step_seconds(self) -> float:
        return self.trace.makespan


def side_by_side(pipes: dict, inputs, targets=None, repeats: int = 5) -> dict[str, SideBySide]:
    """Step each pipeline of `pipes` (name -> pipeline) `repeats` times on the same batch, taking turns (a, b, a,
    b, ...: a busy neighbour on the CPU slows them alike), each step's gradients cleared after it and no update:
    the same work, timed in the same run.  For each: the losses, the trace of the median step, the makespans."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    found = {name: [] for name in pipes}
    for _ in range(repeats):
        for name, pipe in pipes.items():
            found[name].append(pipe.step(inputs, targets))
            for p in pipe.parameters():
                p.grad = None
    out = {}
    for name, results in found.items():
        ordered = sorted(results, key=lambda r: r.trace.makespan)
        out[name] = SideBySide([r.loss for r in results], ordered[len(ordered) // 2].trace,
                               [r.trace.makespan for r in results])
    return out


# ------------------------------------------------------------------------------ 2, 3. training and its losses
def plain_losses(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, steps: int,
                 optimizer: Callable, loss_fn: Callable | None = None) -> list[float]:
    """The single device's training: `steps` plain steps on the whole batch, `optimizer(params)` built once;
    the loss before each update (what `Pipeline.step(...).loss` reports).  On one intra-op thread, as the
    engines run.  `loss_fn`: MSE by default."""
    loss_fn = nn.MSELoss() if loss_fn is None else loss_fn
    opt = optimizer(list(model.parameters()))
    losses = []
    with intra_op_threads(1):
        for _ in range(steps):
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    return losses


def plot_losses(curves: dict[str, Sequence[float]], ax=None, depths: Sequence[int] | None = None, title: str = ""):
    """Loss per step, one line per curve (later ones dashed, drawn on top); `depths`: the stages at each step,
    shaded where they change."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    for k, (name, losses) in enumerate(curves.items()):
        ax.plot(range(len(losses)), losses, linestyle="-" if k == 0 else (0, (4, 3)), linewidth=3 if k == 0 else 1.5,
                marker=None if k == 0 else ".", label=name)
    if depths is not None:
        start, segment = 0, 0
        for step in range(1, len(depths) + 1):
            if step == len(depths) or depths[step] != depths[start]:
                ax.axvspan(start - 0.5, step - 0.5, color="grey", alpha=0.18 if segment % 2 else 0.06, lw=0)
                ax.text((start + step - 1) / 2, 1.0, f"p = {depths[start]}", transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=8)
                start, segment = step, segment + 1
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="step", ylabel="loss")
    ax.set_title(title, pad=14 if depths is not None else None)
    ax.legend(fontsize=8)
    return ax


# ------------------------------------------------------------------------------------------ 4. inference
class InferencePoint(NamedTuple):
    """m requests that arrive together (at 0) on p equal stages of t, forward only, simulated; one device that
    does a stage's work p times over (p·t a request) serves the same requests beside it, one after another."""

    n_microbatches: int
    service_seconds: float  # a request's time inside the pipeline, entering stage 0 to leaving the last: p·t
    latencies: tuple[float, ...]  # request i's, arrival to answer, waiting included: (i + p)·t
    one_device_latencies: tuple[float, ...]  # on one device: (i + 1)·p·t
    step_seconds: float  # the last leaves at (m + p − 1)·t
    throughput: float  # requests per second, m / ((m + p − 1)·t)

    @property
    def last_latency_seconds(self) -> float:
        """The last request's latency: (m + p − 1)·t on the pipeline (m·p·t on one device)."""
        return self.latencies[-1]


def exit_times(trace: Trace) -> list[float]:
    """Per micro-batch, when it leaves the last stage (the end of its last action there), counted from the
    step's start, when every request of the step has arrived: its latency, waiting included."""
    begin = min(e.start for e in trace.events)
    leaves: dict[int, float] = {}
    for e in trace.events:
        if e.stage == trace.n_stages - 1:
            leaves[e.microbatch] = max(leaves.get(e.microbatch, e.end), e.end)
    return [leaves[i] - begin for i in range(trace.n_microbatches)]


def inference_points(n_stages: int, stage_seconds: float, microbatch_counts: Sequence[int],
                     link_seconds: float = 0.0) -> list[InferencePoint]:
    """For each m: `simulate(inference(p, m), Costs(forward=t, latency=L))` (schedules/inference.py) and, for
    one device, `simulate(inference(1, m), Costs(forward=p·t))`.  With a link of L seconds between stages
    (edge devices), a request's service time is p·t + (p − 1)·L and request i's latency (i + p)·t + (p − 1)·L."""
    points = []
    for m in microbatch_counts:
        trace = simulate(inference(n_stages, m), Costs(forward=stage_seconds, latency=link_seconds))
        alone = simulate(inference(1, m), Costs(forward=n_stages * stage_seconds))
        points.append(InferencePoint(m, trace.latencies[0], tuple(exit_times(trace)), tuple(exit_times(alone)),
                                     trace.makespan, trace.throughput))
    return points


def plot_inference(points: Sequence[InferencePoint], n_stages: int, stage_seconds: float, axes=None):
    """Left: throughput against m, beside one device's 1/(p·t) and the limit 1/t; right: the last of m requests'
    latency against m, on the pipeline and on one device, and a request's service time."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    left, right = axes
    ms = [pt.n_microbatches for pt in points]
    left.plot(ms, [pt.throughput for pt in points], marker="o", label="pipeline, m / ((m + p − 1)·t)")
    left.axhline(1 / (n_stages * stage_seconds), color="grey", linestyle="--", label="one device, 1 / (p·t)")
    left.axhline(1 / stage_seconds, color="black", linestyle=":", label="limit, 1 / t")
    left.set(xscale="log", xlabel="requests that arrive together, m", ylabel="requests per second",
             title="throughput grows with m")
    right.plot(ms, [1e3 * pt.one_device_latencies[-1] for pt in points], marker="s", color="grey",
               label="last request's latency, one device, m·p·t")
    right.plot(ms, [1e3 * pt.last_latency_seconds for pt in points], marker="o",
               label="last request's latency, pipeline, (m + p − 1)·t")
    right.plot(ms, [1e3 * pt.service_seconds for pt in points], marker=".", linestyle=":", color="black",
               label="a request's service time, p·t")
    right.set(xscale="log", yscale="log", xlabel="requests that arrive together, m", ylabel="ms",
              title="the last answer comes sooner; service time does not fall")
    for ax in axes:
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.legend(fontsize=8)
    return axes


def median_replay(traces: Sequence[Trace], schedule: Schedule) -> Trace:
    """Each action's median duration over `traces` (passes of one schedule), replayed on one clock per device:
    a shared CPU preempts single actions for several times their length, and the median drops those."""
    medians = {a: statistics.median(t.durations()[a] for t in traces) for a in schedule.all_actions()}
    return simulate(schedule, medians)


def greedy_text(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding on one device, the plain way: the whole sequence through the model for every new token
    (no key/value cache); the prompts followed by `new_tokens` tokens each.  On one intra-op thread, as the
    engines run (common/threads.py: PyTorch's default of a thread per core collapses on a busy CPU)."""
    tokens = prompts
    with torch.no_grad(), intra_op_threads(1):
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(dim=-1)], dim=1)
    return tokens


# ------------------------------------------------------------------------------------- 5. two hosts, one link
# benchmarks/slow_link.py's model (docs/two_hosts.md): an MLP of 48 layers of width 512 (12.6 M parameters),
# batch 512 in 2 micro-batches of 256: few, large all-reduces, so that TP's bytes, not its calls, show
TWO_HOSTS_DEPTH, TWO_HOSTS_WIDTH, TWO_HOSTS_BATCH, TWO_HOSTS_MICROBATCHES = 48, 512, 512, 2
TWO_HOSTS_LAYOUTS = {"PP": Layout(dp=1, pp=2, tp=1), "DP": Layout(dp=2, pp=1, tp=1), "TP": Layout(dp=1, pp=1, tp=2)}
CROSSES = {"PP": "pp", "DP": "dp", "TP": "tp"}  # the one dimension whose traffic crosses the link


def time_one_microbatch(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                        loss_fn: Callable | None = None, repeats: int = 5) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch through the whole model on one thread, the median of
    `repeats` after one untimed warm-up (as benchmarks/slow_link.py measures the model on a rank); `loss_fn`:
    MSE by default."""
    loss_fn = nn.MSELoss() if loss_fn is None else loss_fn
    forward, backward = [], []
    with intra_op_threads(1):
        for k in range(repeats + 1):
            begin = time.perf_counter()
            loss = loss_fn(model(inputs), targets)
            middle = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            if k:
                forward.append(middle - begin)
                backward.append(end - middle)
    model.zero_grad(set_to_none=True)
    return statistics.median(forward), statistics.median(backward)


def two_hosts_model(forward_seconds: float, backward_seconds: float) -> ModelCosts:
    """The benchmark's model as `ModelCosts`: a 256 × 512 float32 activation at a boundary, 12.6 M float32
    parameters, and depth / 4 "layers" of 2 + 2 TP all-reduces (a block pair is one column + row Linear)."""
    width, depth = TWO_HOSTS_WIDTH, TWO_HOSTS_DEPTH
    parameters = depth * (width * width + width)
    return ModelCosts(forward_seconds, backward_seconds,
                      activation_bytes=TWO_HOSTS_BATCH // TWO_HOSTS_MICROBATCHES * width * 4,
                      n_layers=depth // 4, parameter_bytes=parameters * 4)


def predict_two_hosts(model: ModelCosts, bits_per_second: float,
                      latency_seconds: float = 150e-6) -> dict[str, Prediction]:
    """PP, DP and TP of `model` on two hosts joined by one link of `bits_per_second`: `pl.hybrid_costs.predict`
    with that link for every dimension, 1F1B, the global batch's micro-batches shared among the DP replicas."""
    if not (isinstance(bits_per_second, (int, float)) and math.isfinite(bits_per_second) and bits_per_second > 0):
        raise ValueError(f"bits_per_second must be a positive number, got {bits_per_second!r}")
    link = Link(latency_seconds, bits_per_second / 8)
    return {name: predict(layout, model, {"pp": link, "tp": link, "dp": link}, TWO_HOSTS_MICROBATCHES // layout.dp)
            for name, layout in TWO_HOSTS_LAYOUTS.items()}


def link_bytes(name: str, prediction: Prediction) -> float:
    """Bytes on the link per step, both hosts' sends: the two ranks send alike, so twice one device's."""
    return 2 * prediction.bytes_per_device[CROSSES[name]]


def plot_two_hosts(by_rate: dict[str, dict[str, Prediction]], ax=None, title: str = ""):
    """Grouped bars: the predicted step of PP, DP and TP at each link rate (log scale)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    rates = list(by_rate)
    width = 0.8 / len(TWO_HOSTS_LAYOUTS)
    for k, name in enumerate(TWO_HOSTS_LAYOUTS):
        xs = [i + (k - 1) * width for i in range(len(rates))]
        bars = ax.bar(xs, [by_rate[r][name].step_seconds * 1e3 for r in rates], width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(rates)), rates)
    ax.margins(y=0.15)
    ax.set(yscale="log", ylabel="predicted step, ms", title=title)
    ax.legend(fontsize=8)
    return ax


__all__ = ["CROSSES", "PARTS", "TWO_HOSTS_LAYOUTS", "InferencePoint", "SideBySide", "exit_times", "fewest_stages",
           "fullest", "greedy_text", "held_bytes", "inference_points", "link_bytes", "median_replay", "median_seconds",
           "plain_losses",
           "plot_inference", "plot_losses", "plot_state_by_depth", "plot_two_hosts", "predict_two_hosts",
           "side_by_side", "state_by_depth", "time_one_microbatch", "two_hosts_model"]
