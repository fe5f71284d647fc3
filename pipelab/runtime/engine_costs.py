"""What the engine itself adds to every action and message, measured on a model that does almost nothing.

The pieces' costs (`predict/piece_costs.py`) time the ops; the engine adds its own per action (the
loop's bookkeeping, its clock, the transport's posts and waits) and per message (on ranks: more than a
bare ping-pong; `link_probe.py` finds gloo's 50 us one way between local ranks where a message inside
a step costs several times that).  Both are measured here by running the same engine, on the same
placement, over a model of tiny Linear blocks with m = 8, once per family of schedules (`FAMILIES`:
1F1B, ZB-H1, interleaved 1F1B):

    overhead  o = the median action's duration (its op is a few microseconds)
    latency   L = the L for which simulate(that schedule, every action o long, latency L) gives the
                  measured makespan (the median of `steps` steps after 2; bisection: it grows with L)

The local engine hands messages over in-process and replays each action's time on one clock per stage: its
placement takes L = 0 (a fit there would only read the actions' spread around their median).
Pricing a candidate adds its family's o to each of its actions and takes its L as the links' latency:
a schedule with more actions (interleaving doubles them) pays for them, as it does when it runs.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
from torch import nn

from ..predict.costs import Costs
from ..predict.simulate import simulate
from ..schedules.beyond import interleaved_1f1b
from .options import PipelineOptions

PROBE_MICROBATCHES = 8
PROBE_STEPS = 10
FAMILIES = ("whole", "split", "interleaved")
"""What is measured apart: whole backwards (1F1B), split ones (ZB-H1: I and W, one more action per
micro-batch), and two stages per device (interleaved 1F1B: twice the actions and messages, and a device
receiving for two stages)."""


def probe_schedule(family: str, n_devices: int):
    """(the schedule a family is measured with, its number of stages)."""
    if family == "whole":
        return "1f1b", n_devices
    if family == "split":
        return "zb-h1", n_devices
    return interleaved_1f1b(n_devices, PROBE_MICROBATCHES, 2), 2 * n_devices


def measure(make_driver: Callable[[nn.Module, PipelineOptions], object], n_devices: int,
            families: tuple[str, ...] = ("whole", "split"), steps: int = PROBE_STEPS) -> dict[str, tuple[float, float]]:
    """{family: (overhead o, latency L) in seconds} of the engine `make_driver(model, options)` builds, for each
    of `families` (module docstring)."""
    return {family: _measure_one(make_driver, n_devices, family, steps) for family in families}


def _measure_one(make_driver, n_devices: int, family: str, steps: int) -> tuple[float, float]:
    schedule, n_stages = probe_schedule(family, n_devices)
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n_stages)])
    x, y = (torch.randn(2 * PROBE_MICROBATCHES, 8, generator=generator) for _ in range(2))
    options = PipelineOptions(n_microbatches=PROBE_MICROBATCHES, schedule=schedule, loss_fn=nn.functional.mse_loss,
                              check_finite=False)
    driver = make_driver(model, options)
    traces = [driver.step(x, y).trace for _ in range(steps + 2)][2:]
    overhead = statistics.median(e.end - e.start for trace in traces for e in trace.events)
    makespan = statistics.median(trace.makespan for trace in traces)
    return overhead, fitted_latency(driver.schedule, overhead, makespan)


def fitted_latency(schedule, overhead: float, makespan: float, rounds: int = 40) -> float:
    """The latency L >= 0 for which simulate(schedule, every action `overhead` long, latency L) lasts `makespan`."""
    def span(latency: float) -> float:
        return simulate(schedule, Costs(forward=overhead, backward=overhead, weight=overhead,
                                        latency=latency)).makespan

    if span(0.0) >= makespan:
        return 0.0
    low, high = 0.0, makespan
    for _ in range(rounds):
        middle = (low + high) / 2
        low, high = (middle, high) if span(middle) < makespan else (low, middle)
    return (low + high) / 2
