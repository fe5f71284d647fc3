"""Activation memory over a step, per device: step lines up to 8 devices, a devices x time heat-map beyond."""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import MaxNLocator

from ..schedules.trace import Trace, memory_kind
from .plot_style import check_trace, devices_named, distinct_colors, plt, time_unit

HEATMAP_FROM = 9  # devices: from here on, memory() draws a heat-map (one line per device would be a tangle)


def memory(trace: Trace, ax=None, title: str | None = None, predicted: Trace | None = None,
           budget_bytes: float | None = None, unit_bytes: float = 2**20, unit_name: str = "MiB",
           heatmap: bool | None = None, what: str = "counted"):
    """Activation bytes held on each device over the step, peaks marked.

    `what` picks the curve: "counted" (the engine's rule: saved tensors held from F to B,
    the simulator's rule too), "observed" (the storages a stage really kept, measured by
    their lifetimes: an engine's step only), or "allocated" (the CUDA allocator).

    Up to 8 devices: one step line per device.  From 9 on (or with `heatmap=True`): a
    heat-map, one row per device (device 0 on top) and the colour the bytes held, which
    stays readable at 16 or 64 devices.  With `predicted`, draws two panels on one scale:
    the prediction left, `trace` right.  `budget_bytes` draws a per-device memory budget
    (a dashed line; on a heat-map the colour scale ends there and more shows red) and names
    the devices whose peak exceeds it ("out of memory").  The axis counts `unit_name`s of
    `unit_bytes`.
    """
    for t in (trace, predicted) if predicted is not None else (trace,):
        check_trace(t, "memory")
    if heatmap is None:
        heatmap = max(t.n_devices for t in (trace, predicted) if t is not None) >= HEATMAP_FROM
    what = memory_kind(what)
    peaks = trace.peak_memory_by(what)  # a clear error when the trace holds no such samples
    options = dict(budget_bytes=budget_bytes, unit_bytes=unit_bytes, unit_name=unit_name, heatmap=heatmap)
    if predicted is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True, layout="constrained")
        top = max(max(predicted.peak_memory, default=0), max(peaks, default=0))
        for side, t, label, kind in ((left, predicted, "predicted", "counted"), (right, trace, what, what)):
            image = draw_memory(side, t, title=f"{label} — {t.source_label}", top_bytes=top, what=kind, **options)
        if image is not None:
            fig.colorbar(image, ax=[left, right], extend="max" if budget_bytes else "neither",
                         label=f"activation memory ({unit_name})")
        return fig
    if ax is not None:
        image = draw_memory(ax, trace, title, what=what, **options)
        if image is not None:
            ax.figure.colorbar(image, ax=ax, extend="max" if budget_bytes else "neither",
                               label=f"activation memory ({unit_name})")
        ax.figure.tight_layout()
        return ax.figure
    fig, ax = plt.subplots()
    fit_memory(fig, heatmap)
    image = draw_memory(ax, trace, title, legend_outside=True, what=what, **options)
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
                legend_outside: bool = False, top_bytes: float | None = None, what: str = "counted"):
    """Everything `memory` draws for one trace onto an existing (empty) `ax`; returns the heat-map's
    image (for a colour bar) or None.  `top_bytes`: the top of the heat-map's colour scale; `what`:
    the samples drawn ("counted", "observed", ...)."""
    origin = min((e.start for e in trace.events), default=0.0)
    end = trace.makespan  # a property that walks every event: read it once
    scale, unit = time_unit(end, trace.source)
    what = memory_kind(what)
    curves = _memory_curves(trace, origin, scale, end * scale, unit_bytes, what)
    peaks = [bytes_ / unit_bytes for bytes_ in trace.peak_memory_by(what)]
    kept = "activations kept for backward" if what == "counted" else f"activation memory, {what}"
    budget = budget_bytes / unit_bytes if budget_bytes is not None else None
    over = [d for d in range(trace.n_devices) if budget is not None and peaks[d] > budget]
    ax.set_xlabel(unit)
    if heatmap:
        top = budget if budget else max((top_bytes or 0) / unit_bytes, max(peaks, default=0))
        image = _memory_heatmap(ax, trace.n_devices, curves, end * scale, top or 1.0)
        highest = max(range(trace.n_devices), key=peaks.__getitem__) if peaks else 0
        text = title or (f"{trace.schedule_name}: {kept} — {trace.source_label}\n"
                         f"highest peak {peaks[highest]:.3g} {unit_name}, on device {highest}")
    else:
        image = None
        _memory_lines(ax, curves, peaks, budget, unit_name, legend_outside)
        ax.set_ylabel(f"activation memory ({unit_name})")
        text = title or f"{trace.schedule_name}: {kept} — {trace.source_label}"
    if over:
        text += f"\nout of memory on {devices_named(over)}"
    ax.set_title(text, fontsize=10, color="crimson" if over else "black", y=1.0)  # y: see timeline
    return image


def _memory_curves(trace: Trace, origin: float, scale: float, end: float, unit_bytes: float,
                   what: str = "counted") -> dict:
    """device -> (times, levels) of its `what` samples as a step function, up to `end`.

    Sorted by time only: samples at the same time keep the order they were recorded in
    (the last is the level held from then on).  A trace's samples are named by MEMORY_KINDS."""
    samples: dict[int, list] = {}
    for s in trace.memory:
        if s.what == what:
            samples.setdefault(s.device, []).append((s.time, s.bytes))
    curves = {}
    for device, points in sorted(samples.items()):
        table = np.array(sorted(points, key=lambda point: point[0]), dtype=float)
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
