"""Lesson 08's picture of Megatron-style tensor parallelism, for t = 2 ranks (Shoeybi et al. 2019, §3).

    fig = draw_tensor_parallel()

Three panels, in the notation Y = X·A of the paper (A = Wᵀ: torch's nn.Linear keeps W as out × in,
so "columns of A" are rows of `weight`):

- **column-parallel**: A = [A₀ | A₁]; rank r computes Y_r = X·A_r from the whole X, no communication.
  Before it sits f: identity forward, all-reduce of ∂X backward.
- **row-parallel**: X = [X₀ | X₁] (the split output of the column-parallel layer), A = [A₀ ; A₁];
  rank r computes the partial X_r·A_r, and g, an all-reduce, sums them forward (identity backward).
- **stage boundary**: after g every TP rank of stage s holds the whole Y; rank r sends only slice r
  (1/t of it) to rank r of stage s+1, and an all-gather over "tp" there rebuilds Y (Narayanan et al.
  2021, §4.1).

Each rank has one colour; grey is a tensor every rank holds whole.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from .plot_style import distinct_colors

WHOLE = "#BBBBBB"  # a tensor every rank holds whole
TITLES = ("column-parallel Linear", "row-parallel Linear", "stage boundary: scatter, send, all-gather")


def _box(ax, x, y, width, height, color, label, fontsize=10):
    ax.add_patch(Rectangle((x, y), width, height, facecolor=color, edgecolor="black", linewidth=1))
    ax.text(x + width / 2, y + height / 2, label, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, label="", color="black", label_at=None):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=color, linewidth=1.3))
    if label:
        x, y = label_at or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.25)
        ax.text(x, y, label, ha="center", va="bottom", fontsize=9, color=color)


def _column_parallel(ax, colors):
    _arrow(ax, (0.1, 3.2), (1.0, 3.2))
    ax.text(0.55, 3.35, "f", ha="center", va="bottom", fontsize=13, fontweight="bold")
    _box(ax, 1.1, 2.2, 1.2, 2.0, WHOLE, "$X$")
    ax.text(2.6, 3.2, "·", ha="center", va="center", fontsize=16)
    for r, color in enumerate(colors):
        _box(ax, 2.9 + r * 1.0, 1.7, 1.0, 3.0, color, f"$A_{r}$")
    ax.text(5.25, 3.2, "=", ha="center", va="center", fontsize=14)
    for r, color in enumerate(colors):
        _box(ax, 5.7 + r * 1.0, 2.2, 1.0, 2.0, color, f"$Y_{r}$")
    ax.text(4.0, 5.1, "A split by columns (output features)", ha="center", fontsize=9)
    ax.text(4.0, 1.0, "rank r: $Y_r = X A_r$, no communication", ha="center", fontsize=9)
    ax.text(4.0, 0.3, r"f: identity forward, all-reduce of $\partial X$ backward", ha="center", fontsize=9)


def _row_parallel(ax, colors):
    for r, color in enumerate(colors):
        _box(ax, 0.1 + r * 0.8, 2.2, 0.8, 2.0, color, f"$X_{r}$")
    ax.text(2.0, 3.2, "·", ha="center", va="center", fontsize=16)
    for r, color in enumerate(colors):
        _box(ax, 2.3, 3.2 - r * 1.5, 1.6, 1.5, color, f"$A_{r}$")
    ax.text(4.25, 3.2, "→", ha="center", va="center", fontsize=14)
    for r, color in enumerate(colors):
        _box(ax, 4.6, 3.4 - r * 1.5, 1.3, 1.1, color, f"$X_{r} A_{r}$", fontsize=9)
        _arrow(ax, (6.0, 3.95 - r * 1.5), (7.1, 3.2 + 0.3 * (1 - 2 * r)), color=color)
    ax.text(6.45, 3.2, "g", ha="center", va="center", fontsize=13, fontweight="bold")
    _box(ax, 7.2, 2.2, 1.2, 2.0, WHOLE, "$Y$")
    ax.text(4.3, 5.1, "A split by rows (input features)", ha="center", fontsize=9)
    ax.text(4.3, 1.0, "rank r: partial $X_r A_r$; $Y$ = their sum", ha="center", fontsize=9)
    ax.text(4.3, 0.3, "g: all-reduce forward, identity backward", ha="center", fontsize=9)


def _stage_boundary(ax, colors):
    for x, heading in ((1.1, "stage s, after g"), (4.6, "stage s+1 receives"), (8.0, "after the all-gather")):
        ax.text(x, 4.85, heading, ha="center", fontsize=9)
    for r, color in enumerate(colors):
        y = 3.4 - r * 2.0
        ax.text(0.1, y + 0.75, f"TP rank {r}", fontsize=8.5)
        _box(ax, 0.1, y, 1.0, 0.6, colors[0] if r == 0 else WHOLE, "$Y_0$", fontsize=9)
        _box(ax, 1.1, y, 1.0, 0.6, colors[1] if r == 1 else WHOLE, "$Y_1$", fontsize=9)
        _arrow(ax, (2.2, y + 0.3), (4.0, y + 0.3), f"send $Y_{r}$ (1/t)", color=color)
        ax.text(4.1, y + 0.75, f"TP rank {r}", fontsize=8.5)
        _box(ax, 4.1, y, 1.0, 0.6, color, f"$Y_{r}$", fontsize=9)
        _arrow(ax, (5.2, y + 0.3), (6.9, y + 0.3), "all-gather")
        _box(ax, 7.0, y, 1.0, 0.6, colors[0], "$Y_0$", fontsize=9)
        _box(ax, 8.0, y, 1.0, 0.6, colors[1], "$Y_1$", fontsize=9)
    ax.text(4.6, 0.3, "each TP rank sends its 1/t; the other side all-gathers", ha="center", fontsize=9)


def draw_tensor_parallel():
    """The three panels of the module docstring, for t = 2; returns the Figure."""
    colors = distinct_colors(2)
    widths = (8.0, 8.6, 9.2)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6), gridspec_kw={"width_ratios": widths})
    for ax, draw, title, width in zip(axes, (_column_parallel, _row_parallel, _stage_boundary), TITLES, widths):
        draw(ax, colors)
        ax.set_title(title, fontsize=10.5)
        ax.set_xlim(0, width)
        ax.set_ylim(0, 5.5)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


__all__ = ["TITLES", "draw_tensor_parallel"]
