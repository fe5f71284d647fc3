"""Pictures of a Trace: the timeline (who computes what, when) and memory over time.

The same colours everywhere: forward blue, backward orange, weight-gradient green;
idle time is hatched grey, so the bubble is what you see.
"""

from __future__ import annotations

import functools
import sys

import matplotlib

if "ipykernel" not in sys.modules:  # scripts and tests draw to files; notebooks keep their own backend
    matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PathCollection
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path
from matplotlib.textpath import TextPath
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Affine2D

from .trace import Trace

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
IDLE = "#EEEEEE"
WAIT = "#555555"  # waiting for a message (distributed engine)
MESSAGE = "#B03060"  # an activation or gradient in flight


def distinct_colors(n: int) -> list:
    """n colours, no two alike: tab10 up to 10, tab20 up to 20, then evenly spaced on viridis
    (matplotlib's default cycle repeats after 10, so device 10 would look like device 0)."""
    if n <= 10:
        return [plt.get_cmap("tab10")(k) for k in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(k) for k in range(n)]
    return [plt.get_cmap("viridis")(k / (n - 1)) for k in range(n)]


def counted(n: int, noun: str) -> str:
    """"1 device", "2 devices", "1 micro-batch", "3 micro-batches"."""
    return f"{n} {noun if n == 1 else noun + ('es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's')}"


def devices_named(devices: list[int]) -> str:
    """"device 2", "devices 0, 1, 3"."""
    return ("device " if len(devices) == 1 else "devices ") + ", ".join(map(str, devices))


def _time_unit(span: float, source: str) -> tuple[float, str]:
    if source == "simulated" and span >= 1:
        return 1.0, "time (cost-model units)"
    return (1e3, "time (ms)") if span < 10 else (1.0, "time (s)")


def _check_trace(trace, function: str) -> None:
    if not isinstance(trace, Trace):
        raise TypeError(f"{function} expects a pipelab Trace, got {type(trace).__name__}")


def timeline(trace: Trace, ax=None, title: str | None = None, label_microbatches: bool = True):
    """Draw `trace` as a Gantt chart: one row per device (device 0 on top), idle hatched.

    Returns the matplotlib Figure.  The title gives the schedule, p, m, where the times
    came from (simulated / measured / replayed) and the bubble fraction.
    """
    _check_trace(trace, "timeline")
    if ax is None:
        fig, ax = plt.subplots()
        fit_timeline(fig, trace)
        draw_timeline(ax, trace, title, label_microbatches)
    else:
        draw_timeline(ax, trace, title, label_microbatches)
        ax.figure.tight_layout()
    return ax.figure


def fit_timeline(fig, trace: Trace) -> None:
    """Size `fig` for a timeline of `trace` on one axes: the height grows with the devices, and the
    title, the x label and the legend get fixed margins in inches (tight_layout is 2x slower to draw)."""
    height = (0.55 if trace.n_devices <= 8 else 0.4) * trace.n_devices + 1.6
    fig.set_size_inches(10, height)
    left = 0.16 if any(name != "cpu" for name in trace.device_names) else 0.09
    fig.subplots_adjust(left=left, right=0.98, top=1 - 0.55 / height, bottom=0.95 / height)


def draw_timeline(ax, trace: Trace, title: str | None = None, label_microbatches: bool = True) -> None:
    """Everything `timeline` draws, onto an existing (empty) `ax`; the figure's layout is the caller's."""
    scale, unit = _time_unit(trace.makespan, trace.source)
    span = trace.makespan * scale
    _draw(ax, trace, scale, label_microbatches)
    ax.set_xlabel(unit)
    _legend(ax, trace.events, trace.n_devices, bool(trace.waits or trace.messages))
    if title is None:
        title = (f"{trace.schedule_name}: p={counted(trace.n_stages, 'stage')}, "
                 f"m={counted(trace.n_microbatches, 'micro-batch')} — {trace.source_label}\n"
                 f"bubble {trace.bubble_fraction:.1%} of {counted(trace.n_devices, 'device')} x "
                 f"{span:.3g} {unit.split('(')[1].rstrip(')')}")
    ax.set_title(title, fontsize=10, y=1.0)  # y given: matplotlib skips its slow search for a clear spot


def _draw(ax, trace: Trace, scale: float, label_microbatches: bool = True) -> None:
    """One row per device: a hatched idle background, then every action as a rectangle.

    The rectangles of one kind form a single compound path (built with numpy), which keeps
    a p=16, m=64 timeline quick enough to redraw under a slider.
    """
    origin = min((e.start for e in trace.events), default=0.0)
    span = trace.makespan * scale
    rows = np.arange(trace.n_devices, dtype=float)
    # add_artist, not add_patch: the limits are set below, and add_patch would walk every rectangle
    ax.add_artist(PathPatch(_boxes(np.zeros_like(rows), np.full_like(rows, span), rows),
                            facecolor=IDLE, hatch="///", edgecolor="#BBBBBB", linewidth=0))
    # white separators between neighbouring actions, unless the bars are too thin for them to show
    separator = 0.6 if len(trace.events) <= 64 * max(trace.n_devices, 1) else 0.0
    for kind in "FBW":
        chosen = [e for e in trace.events if e.kind == kind]
        if chosen:
            table = np.array([(e.start - origin, e.duration, e.device) for e in chosen], dtype=float)
            boxes = _boxes(table[:, 0] * scale, table[:, 1] * scale, table[:, 2])
            ax.add_artist(PathPatch(boxes, facecolor=COLORS[kind], edgecolor="white", linewidth=separator))
    if label_microbatches and span > 0:
        _microbatch_numbers(ax, trace, origin, scale, span)
    _draw_communication(ax, trace, origin, scale)
    ax.set_xlim(0, span if span > 0 else 1)
    ax.set_ylim(trace.n_devices - 0.5, -0.5)  # device 0 on top
    ax.set_yticks(range(trace.n_devices))
    ax.set_yticklabels([_device_label(trace, d) for d in range(trace.n_devices)])
    ax.tick_params(axis="y", left=False)  # the rows are named: no tick marks (one line each to draw)


def _microbatch_numbers(ax, trace: Trace, origin: float, scale: float, span: float) -> None:
    """Each action's micro-batch number in white on its bar, where the bar is wide enough.

    All the numbers are one collection of glyph outlines (`TextPath`, made once per number
    and size): a text artist per bar made a small timeline three times slower to redraw.
    """
    paths, centres = [], []
    for e in trace.events:
        width = e.duration * scale
        if width / span > 0.012:
            paths.append(_centred_text(str(e.microbatch), 8 if width / span > 0.025 else 6))
            centres.append(((e.start - origin) * scale + width / 2, e.device))
    if paths:
        points = Affine2D().scale(1 / 72) + ax.figure.dpi_scale_trans  # glyphs in points, at any dpi
        ax.add_collection(PathCollection(paths, offsets=centres, offset_transform=ax.transData, transform=points,
                                         facecolors="white", linewidths=0), autolim=False)


@functools.lru_cache(maxsize=512)
def _centred_text(text: str, size: float) -> Path:
    """The outline of `text` at `size` points (matplotlib's font), centred on (0, 0)."""
    path = TextPath((0, 0), text, size=size)
    (x0, y0), (x1, y1) = path.get_extents().get_points()
    return Path(path.vertices - ((x0 + x1) / 2, (y0 + y1) / 2), path.codes)


def _draw_communication(ax, trace: Trace, origin: float, scale: float) -> None:
    """Waits for a message as dark bars in the lower part of a row; each message as a thin arrow."""
    if trace.waits:
        table = np.array([(w.start - origin, w.end - w.start, w.device) for w in trace.waits], dtype=float)
        corners = np.empty((len(table), 4, 2))
        corners[:, [0, 3], 0] = (table[:, 0] * scale)[:, None]
        corners[:, [1, 2], 0] = ((table[:, 0] + table[:, 1]) * scale)[:, None]
        corners[:, [0, 1], 1] = (table[:, 2] + 0.25)[:, None]
        corners[:, [2, 3], 1] = (table[:, 2] + 0.4)[:, None]
        ax.add_artist(PathPatch(Path.make_compound_path_from_polys(corners), facecolor=WAIT, linewidth=0))
    if trace.messages and len(trace.messages) <= 256:
        from matplotlib.collections import LineCollection

        segments = [[((m.sent - origin) * scale, m.source_device), ((m.received - origin) * scale, m.target_device)]
                    for m in trace.messages]
        ax.add_collection(LineCollection(segments, colors=MESSAGE, linewidths=0.8, alpha=0.8), autolim=False)


def _boxes(lefts: np.ndarray, widths: np.ndarray, rows: np.ndarray) -> Path:
    """One compound path of rectangles [left, left + width] x [row - 0.4, row + 0.4]."""
    corners = np.empty((len(lefts), 4, 2))
    corners[:, [0, 3], 0] = lefts[:, None]
    corners[:, [1, 2], 0] = (lefts + widths)[:, None]
    corners[:, [0, 1], 1] = (rows - 0.4)[:, None]
    corners[:, [2, 3], 1] = (rows + 0.4)[:, None]
    return Path.make_compound_path_from_polys(corners)


def _legend(ax, events, n_rows: int, communication: bool = False) -> None:
    kinds = sorted({e.kind for e in events}, key="FBW".index)
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in kinds]
    handles.append(Patch(facecolor=IDLE, hatch="///", edgecolor="#BBBBBB", label="idle (bubble)"))
    if communication:
        handles.append(Patch(color=WAIT, label="waiting for a message"))
        handles.append(Patch(color=MESSAGE, label="message (line: sent -> received)"))
    height = ax.figure.get_figheight() * ax.get_position().height  # inches of the axes
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45 / max(height, 0.5)),
              ncol=len(handles), frameon=False, fontsize=8)


def _device_label(trace: Trace, device: int) -> str:
    if device < len(trace.device_names) and trace.device_names[device].startswith("rank"):
        return trace.device_names[device]  # "rank 1 (cpu)": one process per device
    if device < len(trace.device_names) and trace.device_names[device] not in ("cpu",):
        return f"device {device} ({trace.device_names[device]})"
    return f"device {device}"


COUNTED = ("counted", "activations")  # the samples by the engine's counting rule ("activations": their old name)
HEATMAP_FROM = 9  # devices: from here on, memory() draws a heat-map (one line per device would be a tangle)


def memory(trace: Trace, ax=None, title: str | None = None, predicted: Trace | None = None,
           budget_bytes: float | None = None, unit_bytes: float = 2**20, unit_name: str = "MiB",
           heatmap: bool | None = None):
    """Activation bytes held on each device over the step, peaks marked.

    Up to 8 devices: one step line per device.  From 9 on (or with `heatmap=True`): a
    heat-map, one row per device (device 0 on top) and the colour the bytes held, which
    stays readable at 16 or 64 devices.  With `predicted`, draws two panels on one scale:
    the prediction left, `trace` right.  `budget_bytes` draws a per-device memory budget
    (a dashed line; on a heat-map the colour scale ends there and more shows red) and names
    the devices whose peak exceeds it ("out of memory").  The axis counts `unit_name`s of
    `unit_bytes`.
    """
    for t in (trace, predicted) if predicted is not None else (trace,):
        _check_trace(t, "memory")
    if heatmap is None:
        heatmap = max(t.n_devices for t in (trace, predicted) if t is not None) >= HEATMAP_FROM
    options = dict(budget_bytes=budget_bytes, unit_bytes=unit_bytes, unit_name=unit_name, heatmap=heatmap)
    if predicted is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True, layout="constrained")
        top = max(max(t.peak_memory, default=0) for t in (trace, predicted))
        for side, t, label in ((left, predicted, "predicted"), (right, trace, "measured")):
            image = draw_memory(side, t, title=f"{label} — {t.source_label}", top_bytes=top, **options)
        if image is not None:
            fig.colorbar(image, ax=[left, right], extend="max" if budget_bytes else "neither",
                         label=f"activation memory ({unit_name})")
        return fig
    if ax is not None:
        image = draw_memory(ax, trace, title, **options)
        if image is not None:
            ax.figure.colorbar(image, ax=ax, extend="max" if budget_bytes else "neither",
                               label=f"activation memory ({unit_name})")
        ax.figure.tight_layout()
        return ax.figure
    fig, ax = plt.subplots()
    fit_memory(fig, heatmap)
    image = draw_memory(ax, trace, title, legend_outside=True, **options)
    if image is not None:
        colorbar(fig, image, unit_name, budget_bytes)
    return fig


def fit_memory(fig, heatmap: bool) -> None:
    """Size `fig` for `memory` on one axes with fixed margins (tight_layout is slow): room on the
    right for the legend beside the lines, or for the heat-map's colour bar."""
    fig.set_size_inches(10, 3.5)
    fig.subplots_adjust(left=0.08, right=0.86 if heatmap else 0.78, top=0.84, bottom=0.15)


def colorbar(fig, image, unit_name: str, budget_bytes: float | None, bar=None):
    """The heat-map's colour bar, in the right margin `fit_memory` leaves; `bar`: one to update instead
    (it is replaced only when a budget comes or goes: the bar's red end for "over budget" with it)."""
    extend = "max" if budget_bytes else "neither"
    if bar is not None and bar.extend != extend:
        bar.ax.remove()  # (not bar.remove(): that looks for the first image, which is gone)
        bar = None
    if bar is None:
        bar = fig.colorbar(image, cax=fig.add_axes((0.88, 0.15, 0.015, 0.69)), extend=extend)
    else:
        bar.update_normal(image)
    bar.set_ticks(MaxNLocator(5))  # a few round numbers: each tick label costs as much to draw as a bar
    bar.set_label(f"activation memory ({unit_name})", fontsize=8)
    return bar


def draw_memory(ax, trace: Trace, title: str | None = None, budget_bytes: float | None = None,
                unit_bytes: float = 2**20, unit_name: str = "MiB", heatmap: bool = False,
                legend_outside: bool = False, top_bytes: float | None = None):
    """Everything `memory` draws for one trace onto an existing (empty) `ax`; returns the heat-map's
    image (for a colour bar) or None.  `top_bytes`: the top of the heat-map's colour scale."""
    origin = min((e.start for e in trace.events), default=0.0)
    end = trace.makespan  # a property that walks every event: read it once
    scale, unit = _time_unit(end, trace.source)
    curves = _memory_curves(trace, origin, scale, end * scale, unit_bytes)
    peaks = [bytes_ / unit_bytes for bytes_ in trace.peak_memory]
    budget = budget_bytes / unit_bytes if budget_bytes is not None else None
    over = [d for d in range(trace.n_devices) if budget is not None and peaks[d] > budget]
    ax.set_xlabel(unit)
    if heatmap:
        top = budget if budget else max((top_bytes or 0) / unit_bytes, max(peaks, default=0))
        image = _memory_heatmap(ax, trace.n_devices, curves, end * scale, top or 1.0)
        highest = max(range(trace.n_devices), key=peaks.__getitem__) if peaks else 0
        text = title or (f"{trace.schedule_name}: activations kept for backward — {trace.source_label}\n"
                         f"highest peak {peaks[highest]:.3g} {unit_name}, on device {highest}")
    else:
        image = None
        _memory_lines(ax, curves, peaks, budget, unit_name, legend_outside)
        ax.set_ylabel(f"activation memory ({unit_name})")
        text = title or f"{trace.schedule_name}: activations kept for backward — {trace.source_label}"
    if over:
        text += f"\nout of memory on {devices_named(over)}"
    ax.set_title(text, fontsize=10, color="crimson" if over else "black", y=1.0)  # y: see timeline
    return image


def _memory_curves(trace: Trace, origin: float, scale: float, end: float, unit_bytes: float) -> dict:
    """device -> (times, levels) of its activation memory as a step function, up to `end`."""
    samples: dict[int, list] = {}
    for s in trace.memory:
        if s.what in COUNTED:
            samples.setdefault(s.device, []).append((s.time, s.bytes))
    curves = {}
    for device, points in sorted(samples.items()):
        table = np.array(sorted(points), dtype=float)
        times = np.append((table[:, 0] - origin) * scale, end)
        levels = np.append(table[:, 1], table[-1, 1]) / unit_bytes
        curves[device] = (times, levels)
    return curves


def _memory_lines(ax, curves: dict, peaks: list, budget: float | None, unit_name: str, legend_outside: bool):
    """One step line per device, a dot on its first peak, the budget dashed; the legend beside or inside."""
    colors = distinct_colors(len(peaks))
    tops = []
    for device, (times, levels) in curves.items():
        ax.step(times, levels, where="post", color=colors[device], label=f"device {device}: peak {peaks[device]:.3g}")
        top = int(np.argmax(levels))
        tops.append((times[top], levels[top], colors[device]))
    if tops:
        top_x, top_y, top_colors = zip(*tops)
        ax.scatter(top_x, top_y, c=top_colors, zorder=3, s=25)
    if budget is not None:
        ax.axhline(budget, color="crimson", ls="--", lw=1.2, label=f"budget {budget:.3g} {unit_name}")
    if legend_outside:  # beside the plot, so it never hides a curve
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.02), frameon=False)
    else:
        ax.legend(fontsize=8, loc="upper right")


def _memory_heatmap(ax, n_devices: int, curves: dict, end: float, top: float):
    """Rows = devices, columns = the intervals between memory changes, colour = the level held.

    Exact: the columns are the step functions' own intervals (`pcolorfast` draws them as one image).
    """
    edges = np.unique(np.concatenate([[0.0, end], *(times for times, _ in curves.values())]))
    edges = edges[(edges >= 0) & (edges <= end)]
    if len(edges) < 2:
        edges = np.array([0.0, end or 1.0])
    values = np.zeros((n_devices, len(edges) - 1))
    for device, (times, levels) in curves.items():
        index = np.searchsorted(times, edges[:-1], side="right") - 1  # the last change at or before each start
        values[device] = np.where(index >= 0, levels[np.maximum(index, 0)], 0.0)
    colours = plt.get_cmap("Blues").with_extremes(over="crimson")
    image = ax.pcolorfast(edges, np.arange(n_devices + 1) - 0.5, values, cmap=colours, vmin=0, vmax=top)
    ax.set_xlim(0, edges[-1])
    ax.set_ylim(n_devices - 0.5, -0.5)  # device 0 on top, as in the timeline
    step = -(-n_devices // 8)  # at most 8 device numbers on the axis (16 devices: 0, 2, ..., 14)
    ax.set_yticks(range(0, n_devices, step))
    ax.set_yticklabels([str(d) for d in range(0, n_devices, step)], fontsize=8)
    ax.tick_params(axis="y", left=False)
    ax.set_ylabel("device")
    return image


def partition(parts, ax=None, title: str | None = None):
    """Bar chart of per-block costs, coloured by stage, with each stage's total: where the cuts fall.

    `parts` is a `pl.split` result.  The slowest (most expensive) stage is named in the title:
    in a pipeline it sets the pace of every other stage.
    """
    from .partition import Partition

    if not isinstance(parts, Partition):
        raise TypeError(f"partition expects the result of pl.split, got {type(parts).__name__}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 3.2))
    else:
        fig = ax.figure
    totals = parts.stage_costs
    colors = distinct_colors(len(parts.bounds))
    for s, (a, b) in enumerate(parts.bounds):
        ax.bar(range(a, b), parts.block_costs[a:b], color=colors[s], edgecolor="white",
               label=f"stage {s}: {f'block {a}' if b - a == 1 else f'blocks {a}..{b - 1}'}, cost {totals[s]:.3g}")
    ax.set_xlabel("block")
    ax.set_ylabel({"uniform": "cost (1 per block)", "params": "parameters", "time": "seconds (F + B)"}[parts.method])
    ax.set_xticks(range(len(parts.block_costs)))
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    slowest = max(range(len(totals)), key=totals.__getitem__)
    balance = min(totals) / max(totals) if max(totals) > 0 else 1.0
    ax.set_title(title or f"split by {parts.method!r} into {counted(len(parts), 'stage')}: heaviest is stage {slowest}, "
                          f"lightest/heaviest = {balance:.2f}", fontsize=10)
    fig.tight_layout()
    return fig


def compare(predicted: Trace, measured: Trace, labels: tuple[str, str] = ("predicted", "measured")):
    """Two timelines stacked on one time axis: the prediction above, the measurement below."""
    for trace in (predicted, measured):
        if not isinstance(trace, Trace):
            raise TypeError(f"compare expects two pipelab Traces, got {type(trace).__name__}")
    return stacked({labels[0]: predicted, labels[1]: measured})


def stacked(traces: dict[str, Trace], title: str | None = None):
    """Timelines one above the other on one time axis, each titled with its label, where its times came
    from (said once when the label is its source), its makespan and its bubble; one legend, at the bottom."""
    if not traces or not all(isinstance(t, Trace) for t in traces.values()):
        raise TypeError("stacked expects a dict of label -> pipelab Trace")
    rows = sum(t.n_devices for t in traces.values())
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 0.5 * rows + 1.1 * len(traces) + 0.8), sharex=True,
                             squeeze=False)
    axes = axes[:, 0]
    all_simulated = all(t.source == "simulated" for t in traces.values())
    longest = max(t.makespan for t in traces.values())
    scale, unit = _time_unit(longest, "simulated" if all_simulated else "measured")
    for ax, (label, trace) in zip(axes, traces.items()):
        _draw(ax, trace, scale)
        name = trace.source_label if label == trace.source else f"{label} — {trace.source_label}"
        ax.set_title(f"{name}: makespan {trace.makespan * scale:.4g} {unit.split('(')[1].rstrip(')')}, "
                     f"bubble {trace.bubble_fraction:.1%}", fontsize=10)
    axes[0].set_xlim(0, longest * scale if longest > 0 else 1)
    axes[-1].set_xlabel(unit)
    every = list(traces.values())
    _legend(axes[-1], [e for t in every for e in t.events], n_rows=every[-1].n_devices,
            communication=any(t.waits or t.messages for t in every))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def bubble_vs_microbatches(stages=(2, 4, 8, 16), max_microbatches: int = 64, schedule: str = "gpipe", ax=None):
    """Simulated bubble fraction against m for several p (dots), with (p-1)/(m+p-1) drawn as lines.

    Formula: GPipe §2.3; Megatron-LM SC21 §2.2.1 (uniform stages, no communication).
    """
    from .costs import Costs
    from .schedules import by_name
    from .simulate import simulate

    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4))
    else:
        fig = ax.figure
    cmap = plt.get_cmap("viridis")
    ms = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, max_microbatches} & set(range(1, max_microbatches + 1)))
    dense = list(range(1, max_microbatches + 1))
    for k, p in enumerate(stages):
        color = cmap(k / max(1, len(stages) - 1) * 0.9)
        ax.plot(dense, [(p - 1) / (m + p - 1) for m in dense], color=color, lw=1.5, label=f"p={p}: (p-1)/(m+p-1)")
        measured = [simulate(by_name(schedule, p, m), Costs(1.0, 2.0)).bubble_fraction for m in ms]
        ax.plot(ms, measured, "o", color=color, ms=4)
    ax.axhline(0, color="#999999", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction of the step")
    ax.set_title(f"{schedule}: simulated (dots) vs formula (lines)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
