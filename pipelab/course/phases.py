"""A fill-drain (GPipe) step's phases: fill, steady state, drain, once for the forward pass and once for the backward.

With p stages, m >= p micro-batches and uniform costs t_F, t_B (GPipe, Huang et al. 2019, §2.3):

    forward:   fill [0, (p-1) t_F)   steady [(p-1) t_F, m t_F)   drain [m t_F, (m+p-1) t_F)
    backward:  the same with t_B, starting at T = (m+p-1) t_F, the end of the last forward

In a steady-state phase all p devices compute; in fill and drain fewer do.  `busy_devices`
reads that off a Trace, exactly (the count is constant between event boundaries).
"""

from __future__ import annotations

from typing import NamedTuple

from ..common.checks import check_counts
from ..schedules.trace import Trace


class Phase(NamedTuple):
    pass_name: str  # "forward" or "backward"
    name: str       # "fill", "steady state" or "drain"
    start: float
    end: float


def fill_drain_phases(n_stages: int, n_microbatches: int, forward: float = 1.0, backward: float = 2.0) -> list[Phase]:
    """The six phases of a GPipe step with uniform costs (needs m >= p, so that a steady state exists)."""
    p, m = n_stages, n_microbatches
    check_counts(n_stages=p, n_microbatches=m)
    if m < p:
        raise ValueError(f"phases need n_microbatches >= n_stages, got p={p}, m={m}")
    if not (forward > 0 and backward > 0):
        raise ValueError(f"forward and backward times must be > 0, got {forward!r}, {backward!r}")
    phases = []
    offset = 0.0
    for pass_name, t in (("forward", float(forward)), ("backward", float(backward))):
        edges = [offset, offset + (p - 1) * t, offset + m * t, offset + (m + p - 1) * t]
        phases += [Phase(pass_name, name, a, b) for name, a, b in zip(("fill", "steady state", "drain"), edges, edges[1:])]
        offset = edges[-1]
    return phases


def busy_devices(trace: Trace, start: float, end: float) -> tuple[int, int]:
    """The fewest and the most devices computing at any moment in [start, end) of the trace."""
    if not end > start:
        raise ValueError(f"an interval needs end > start, got [{start}, {end})")
    edges = sorted({start, end} | {t for e in trace.events for t in (e.start, e.end) if start < t < end})
    counts = []
    for a, b in zip(edges, edges[1:]):
        middle = (a + b) / 2
        counts.append(len({e.device for e in trace.events if e.start <= middle < e.end}))
    return min(counts), max(counts)
