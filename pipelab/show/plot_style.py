"""What every pipelab picture shares: the backend, the colours, counted nouns, the time unit.

The same colours everywhere: forward blue, backward orange, weight-gradient green;
idle time is hatched grey, so the bubble is what you see.
"""

from __future__ import annotations

import sys

import matplotlib

if "ipykernel" not in sys.modules:  # scripts and tests draw to files; notebooks keep their own backend
    matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from ..schedules.action import KIND_SPECS  # noqa: E402
from ..schedules.trace import Trace  # noqa: E402

COLORS = {kind.value: spec.color for kind, spec in KIND_SPECS.items()}  # one per `Kind`, from its row
NAMES = {kind.value: spec.name for kind, spec in KIND_SPECS.items()}
IDLE = "#EEEEEE"
WAIT = "#555555"  # waiting for a message (distributed engine)
MESSAGE = "#B03060"  # an activation or gradient in flight


def chunk_shade(color: str, chunk: int) -> tuple:
    """`color` for a device's first chunk (stage), darker for its second, lighter for a third, and so on (a
    device of an interleaved or V-shaped schedule runs several stages; Megatron-LM's interleaving figure
    shades them apart the same way)."""
    from matplotlib.colors import to_rgb

    rgb = to_rgb(color)
    if chunk == 0:
        return rgb
    toward, amount = ((0.0, 0.0, 0.0), 0.4) if chunk % 2 else ((1.0, 1.0, 1.0), min(0.25 * chunk / 2 + 0.2, 0.6))
    return tuple(c + (t - c) * amount for c, t in zip(rgb, toward))


def chunks_of(trace: Trace) -> dict[int, int]:
    """{stage: its index among the stages of its device, in stage order} (0 everywhere for one stage per device)."""
    on_device: dict[int, set[int]] = {}
    for e in trace.events:
        on_device.setdefault(e.device, set()).add(e.stage)
    return {stage: k for stages in on_device.values() for k, stage in enumerate(sorted(stages))}


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


def time_unit(span: float, source: str) -> tuple[float, str]:
    """(scale, axis label) for times spanning `span` seconds (or cost-model units, when simulated)."""
    if source == "simulated" and span >= 1:
        return 1.0, "time (cost-model units)"
    return (1e3, "time (ms)") if span < 10 else (1.0, "time (s)")


def check_trace(trace, function: str) -> None:
    """A clear TypeError when a plot is handed something other than a Trace."""
    if not isinstance(trace, Trace):
        raise TypeError(f"{function} expects a pipelab Trace, got {type(trace).__name__}")
