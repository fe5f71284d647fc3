"""`decide`: the cut and the schedule chosen together, by simulating every candidate on measured costs.

A candidate is a cut of the model's pieces into stages (`piece_costs.PieceCosts`) and a schedule:

    predicted(cut, schedule) = simulate(schedule, stage_costs(cut), checkpoint).makespan

with F, B (or I and W for a schedule with W actions) summed over each stage's pieces, each action
longer by what the engine adds to it (`runtime/engine_costs.py`), and each message taking latency +
bytes / bandwidth.  The choice is the smallest prediction that fits the memory limit
(each device's parameters, gradients, optimizer state and its schedule's activation peak,
`budget.device_memory`); predictions within `TIE` of it are a tie, won by the least activation memory.  The two are decided together because the best cut depends on the schedule:
under ZB-H1 the last stage defers its W's into what would be idle, so it can carry more than under
1F1B; an interleaved schedule cuts the model in p·v stages, not p.

The cuts priced: every contiguous cut whose largest stage (F + B) is within `SLACK` of the smallest
possible (`partition.balanced_bounds`, which minimises it exactly), at most `MAX_CUTS` of them, the
most balanced first — a cut far from balanced cannot win, whatever its schedule.  The schedules: GPipe,
1F1B and ZB-H1 on every cut, interleaved 1F1B (v = 2) where the placement allows several stages per
device, and `search_schedule`'s result (under the memory limit) on the `SEARCHED` best cuts.

Checked by running it: `benchmarks/auto.py` measures the chosen plan and its nearest rivals and prints
each prediction beside its measurement and the regret of the choice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..model.partition import balanced_bounds
from ..schedules.beyond import interleaved_1f1b
from ..schedules.generators import by_name
from ..schedules.schedule import Schedule
from .costs import Costs
from .piece_costs import PieceCosts
from .schedule_search import search_schedule
from .simulate import simulate

SLACK = 0.2
"""Cuts priced: those whose largest stage is at most (1 + SLACK) times the most balanced cut's."""
MAX_CUTS = 40
"""At most this many cuts per stage count (the most balanced first)."""
SEARCHED = 3
"""`search_schedule` runs on this many of the best cuts (it costs a fraction of a second each)."""
TIE = 0.005
"""Predictions within this share of the fastest are a tie (the simulator is not that exact): the least
activation memory wins it (GPipe and 1F1B predict the same step; 1F1B holds p micro-batches, not m)."""
NAMED = ("gpipe", "1f1b", "zb-h1")
SCHEDULES = (*NAMED, "interleaved", "search")
"""What schedule="auto" chooses among."""


@dataclass(frozen=True)
class Candidate:
    """One cut and schedule, its predicted step seconds, and whether it fits (`needs`: each device's
    `DeviceMemory`, when a memory limit is given)."""

    bounds: tuple[tuple[int, int], ...]
    schedule_name: str
    schedule: Schedule = field(repr=False)
    costs: Costs = field(repr=False)
    predicted: float
    peak: float = 0.0  # the largest device's predicted activation bytes (the counted rule, `predict/memory.py`)
    fits: bool = True
    needs: tuple | None = field(default=None, repr=False)


@dataclass
class AutoPlan:
    """What split_method="auto" and/or schedule="auto" decided (`pipe.plan`): every candidate priced, the
    fastest that fits first.  `points[k]` is where piece k + 1 begins; a candidate's stages are pieces."""

    candidates: list[Candidate]
    points: list[str]
    decided: str  # "cut and schedule", "cut" or "schedule"
    n_devices: int
    checkpoint: str | list[bool] = "never"
    seconds: float = 0.0
    link: tuple[float, float] = (0.0, math.inf)  # (latency s, bandwidth B/s) the messages were priced with
    engine: dict | None = None  # {family: (seconds added to every action, a message's latency)}, measured

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    def split_points(self, candidate: Candidate | None = None) -> list[str]:
        """The module names where the candidate's (default: the chosen) stages 1, 2, ... begin."""
        candidate = self.chosen if candidate is None else candidate
        return [self.points[a - 1] for a, _ in candidate.bounds[1:]]

    def trace(self, candidate: Candidate | None = None):
        """The predicted timeline of the candidate (default: the chosen one): `pl.plot.timeline(plan.trace())`."""
        candidate = self.chosen if candidate is None else candidate
        return simulate(candidate.schedule, candidate.costs, self.checkpoint)

    def within(self, share: float) -> list[Candidate]:
        """The candidates that fit and are predicted within `share` (0.1: 10 %) of the chosen one."""
        return [c for c in self.candidates if c.fits and c.predicted <= self.chosen.predicted * (1 + share)]

    def table(self, n_rows: int = 8) -> str:
        """The best `n_rows` candidates: cut, schedule, predicted step, against the chosen one."""
        best = self.chosen.predicted
        shown = self.candidates[:n_rows]
        width = max(len("cut before"), *(len(", ".join(self.split_points(c))) for c in shown))
        named = max(len("schedule"), *(len(c.schedule_name) for c in shown))
        lines = [f"decided: the {self.decided}, from {len(self.candidates)} candidates priced in {self.seconds:.2f} s "
                 f"({self.n_devices} devices)",
                 f"  {'cut before':<{width}}  {'schedule':<{named}}  predicted  vs chosen"]
        for c in shown:
            mark = "" if c.fits else "  (over the memory limit)"
            lines.append(f"  {', '.join(self.split_points(c)):<{width}}  {c.schedule_name:<{named}}  "
                         f"{c.predicted * 1e3:6.1f} ms  {c.predicted / best:9.3f}{mark}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def decide(pieces: PieceCosts, n_devices: int, n_microbatches: int, *, cut: Sequence[tuple[int, int]] | None = None,
           schedules: Sequence[str] = SCHEDULES, interleave: bool = False, latency: float = 0.0,
           bandwidth: float = math.inf, engine: dict[str, tuple[float, float]] | None = None,
           checkpoint: str | list[bool] = "never",
           needs: Callable[[tuple, Schedule, Costs], list] | None = None,
           limits: Sequence[float] | None = None) -> AutoPlan:
    """The fastest candidate that fits (module docstring), and every other one priced.

    `cut`: a fixed cut (the stages' piece bounds; only the schedule is chosen), or None to choose it.
    `schedules`: the names to choose among (`SCHEDULES`; one name: only the cut is chosen).  `interleave`:
    the placement runs several stages per device (interleaved 1F1B, v = 2, joins).  `latency`, `bandwidth`: the
    links; `engine`: {"whole" | "split" | "interleaved": (seconds the engine adds to every action, the latency
    of its messages)}, as `runtime/engine_costs.py` measures them, overriding `latency` for that family of
    schedules (more actions then cost more).  `needs(bounds, schedule, costs)`: each device's `DeviceMemory`
    (`budget.device_memory`), with `limits` its bytes.
    """
    began = time.perf_counter()
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule {unknown[0]!r} to decide among; choose from {SCHEDULES}")
    p, m = n_devices, n_microbatches
    link = dict(latency=latency, bandwidth=bandwidth)
    found: list[Candidate] = []

    def price(bounds: tuple, name: str, schedule: Schedule, split: bool) -> Candidate:
        costs = pieces.stage_costs(list(bounds), split, **{**link, **_engine_terms(engine, name, split)})
        trace = simulate(schedule, costs, checkpoint)
        peak = float(max(trace.peak_memory, default=0))
        if needs is None:
            return Candidate(bounds, name, schedule, costs, trace.makespan, peak)
        held = tuple(needs(bounds, schedule, costs))
        return Candidate(bounds, name, schedule, costs, trace.makespan, peak,
                         all(n.total_bytes <= lim for n, lim in zip(held, limits)), held)

    cuts = [tuple(cut)] if cut is not None else balanced_cuts(pieces.step_seconds(), p)
    for bounds in cuts:
        for name in NAMED:
            if name in schedules:
                found.append(price(bounds, name, by_name(name, p, m), split=name == "zb-h1"))
    if "interleaved" in schedules and interleave and cut is None and m % p == 0 and pieces.n_pieces >= 2 * p:
        for bounds in balanced_cuts(pieces.step_seconds(), 2 * p):
            found.append(price(bounds, "interleaved (v=2)", interleaved_1f1b(p, m, 2), split=False))
    if "search" in schedules:
        ranked = sorted((c for c in found if c.fits and len(c.bounds) == p), key=lambda c: c.predicted)
        searched: list[tuple] = []
        for c in ranked:
            if c.bounds not in searched and len(searched) < SEARCHED:
                searched.append(c.bounds)
                found.append(_searched(pieces, c, p, m, link, engine, limits, price))
    if not found:
        raise ValueError(f"nothing to decide among: schedules={list(schedules)} for {p} devices")
    order = {id(c): k for k, c in enumerate(found)}
    found.sort(key=lambda c: (not c.fits, round(c.predicted, 12), order[id(c)]))
    level = [c for c in found if c.fits == found[0].fits and c.predicted <= found[0].predicted * (1 + TIE)]
    first = min(level, key=lambda c: (c.peak, c.predicted, order[id(c)]))  # a tie goes to the least memory
    found.remove(first)
    found.insert(0, first)
    decided = ("cut and schedule" if cut is None and len(schedules) > 1 else "cut" if cut is None else "schedule")
    return AutoPlan(found, list(pieces.points), decided, p, checkpoint, time.perf_counter() - began,
                    (latency, bandwidth), engine)


def _engine_terms(engine: dict | None, name: str, split: bool) -> dict:
    """{latency, overhead} for a candidate: its family's measured engine costs, or the given latency alone."""
    if not engine:
        return {}
    family = "interleaved" if name.startswith("interleaved") else "split" if split else "whole"
    overhead, measured = engine.get(family, engine["whole"])
    return {"latency": measured, "overhead": overhead}


def _searched(pieces: PieceCosts, near: Candidate, p: int, m: int, link: dict, engine, limits,
              price) -> Candidate:
    """`search_schedule` on `near`'s cut with split backwards, under what the memory limit leaves the
    activations (the smallest over devices of limit - model state), priced like every other candidate."""
    costs = pieces.stage_costs(list(near.bounds), True, **{**link, **_engine_terms(engine, "search", True)})
    room = None
    if near.needs is not None:
        room = max(min(lim - n.model_state_bytes for n, lim in zip(near.needs, limits)), 0.0)
    try:
        found = search_schedule(p, m, costs, room, exact=False)
    except ValueError:  # not even one micro-batch per stage fits: the named ones say so already
        return Candidate(near.bounds, "search", near.schedule, near.costs, math.inf, fits=False, needs=near.needs)
    return price(near.bounds, f"search ({found.meta['found_by']})", found, split=True)


def balanced_cuts(weights: Sequence[float], n_stages: int, slack: float = SLACK,
                  limit: int = MAX_CUTS) -> list[tuple[tuple[int, int], ...]]:
    """The contiguous cuts of `weights` into `n_stages` stages whose largest stage is within `slack` of the
    most balanced cut's, the most balanced first, at most `limit` (a depth-first walk that stops a stage as
    soon as it outweighs the bound)."""
    n = len(weights)
    if n_stages > n:
        raise ValueError(f"cannot cut {n} pieces into {n_stages} stages: every stage needs at least one piece")
    best = max(sum(weights[a:b]) for a, b in balanced_bounds(weights, n_stages))
    bound = best * (1 + slack) + 1e-12
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    found: list[tuple[float, tuple]] = []

    def walk(start: int, left: int, bounds: list, heaviest: float) -> None:
        if left == 1:
            last = prefix[n] - prefix[start]
            if last <= bound:
                found.append((max(heaviest, last), tuple(bounds + [(start, n)])))
            return
        for end in range(start + 1, n - left + 2):
            weight = prefix[end] - prefix[start]
            if weight > bound:
                break
            walk(end, left - 1, bounds + [(start, end)], max(heaviest, weight))

    walk(0, n_stages, [], 0.0)
    found.sort(key=lambda item: (round(item[0], 12), item[1]))
    return [bounds for _, bounds in found[:limit]]
