"""Pictures of a Trace: the timeline (who computes what, when), memory over time (`plot_memory`),
predicted beside measured, a split model's stage costs, the bubble against its formula.

The same colours everywhere: forward blue, backward orange, weight-gradient green;
idle time is hatched grey, so the bubble is what you see.
"""

from __future__ import annotations

import functools

import numpy as np
from matplotlib.collections import PathCollection
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path
from matplotlib.textpath import TextPath
from matplotlib.transforms import Affine2D

from ..model.partition import Partition
from ..predict.costs import Costs
from ..predict.simulate import simulate
from ..schedules import by_name
from ..schedules.trace import Trace
from .plot_memory import HEATMAP_FROM, colorbar, draw_memory, fit_memory, memory  # noqa: F401 (pl.plot.memory)
from .plot_style import (  # noqa: F401
    COLORS,
    IDLE,
    MESSAGE,
    NAMES,
    WAIT,
    check_trace,
    chunk_shade,
    chunks_of,
    counted,
    devices_named,
    distinct_colors,
    plt,
    time_unit,
)


def timeline(trace: Trace, ax=None, title: str | None = None, label_microbatches: bool = True):
    """Draw `trace` as a Gantt chart: one row per device (device 0 on top), idle hatched.

    Returns the matplotlib Figure.  The title gives the schedule, p, m, where the times
    came from (simulated / measured / replayed) and the bubble fraction.
    """
    check_trace(trace, "timeline")
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
    scale, unit = time_unit(trace.makespan, trace.source)
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
    # several stages on a device: each its own shade (one stage per device: one pass per kind, as before)
    chunk = chunks_of(trace) if trace.n_stages > trace.n_devices else None
    for kind in COLORS:
        for k in (sorted(set(chunk.values())) if chunk else [0]):
            chosen = [e for e in trace.events if e.kind == kind and (chunk is None or chunk[e.stage] == k)]
            if chosen:
                table = np.array([(e.start - origin, e.duration, e.device) for e in chosen], dtype=float)
                boxes = _boxes(table[:, 0] * scale, table[:, 1] * scale, table[:, 2])
                ax.add_artist(PathPatch(boxes, facecolor=chunk_shade(COLORS[kind], k), edgecolor="white",
                                        linewidth=separator))
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
    kinds = [kind for kind in COLORS if any(e.kind == kind for e in events)]
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in kinds]
    on_device = {(e.device, e.stage) for e in events}
    if len(on_device) > len({device for device, _ in on_device}):  # some device runs several stages
        handles.append(Patch(color=chunk_shade(COLORS["F"], 1), label="darker: a device's 2nd stage (chunk)"))
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


def partition(parts, ax=None, title: str | None = None):
    """Bar chart of per-block costs, coloured by stage, with each stage's total: where the cuts fall.

    `parts` is a `pl.split` result.  The slowest (most expensive) stage is named in the title:
    in a pipeline it sets the pace of every other stage.
    """
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
    scale, unit = time_unit(longest, "simulated" if all_simulated else "measured")
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
