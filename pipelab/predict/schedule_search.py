"""`search_schedule(n_stages, n_microbatches, costs, memory_limit)`: a schedule found, not written.

The search builds tables of F and B, or F, I and W, actions whose simulated makespan is as short
as it can find while each device holds at most `memory_limit`.  Three sources of candidates:

1. **list scheduling on the simulator** (any size): a discrete-event run in which each device,
   whenever it is free, picks one of its ready actions by a priority rule — the gradient action
   (I, or B) whose gradient arrived first; the forward of the next micro-batch while the memory
   and a warm-up cap allow it; an owed weight gradient (W), oldest first.  The rules tried: two
   orders (I > F > W, the 1F1B instinct; F > I > W, GPipe's), each with a cap of p - s + extra
   micro-batches started and not yet sent back on stage s, extra in (0, 1, 2, 4, none).  W runs
   only when nothing else is ready or the memory is full, so the W's fill what would be idle
   (Zero Bubble PP's idea, Qi et al. 2024, §3).  A device with several stages (chunks) lets a
   micro-batch in only with room for all its chunks, so a full device cannot deadlock.
2. **an exact search** for tiny sizes (p·m ≤ 6 by default): branch and bound over every order of
   every device (`_exact`), proving the optimum.  OR-Tools or HiGHS would be the well-kept
   solvers for larger exact models; neither is a pipelab dependency, and at the sizes an
   enumeration proves in a second the model is the simulator itself, with nothing to translate.
3. **the named schedules** that fit: GPipe, 1F1B and ZB-H1 (and interleaved 1F1B with chunks).

The result is the best of all (ties: the least idle inside each device's span, then the least
memory), so it is never worse than a named schedule that fits — by construction; `meta` says
which candidate won, what each gave, and whether the optimum is proven.

Costs: F takes `forward[s]`, I `backward[s]` and W `weight[s]` (Zero Bubble PP's T_F, T_B, T_W);
a whole backward B takes backward + weight.  With `weight` 0 everywhere the search builds F/B
tables; otherwise F/I/W tables (a named schedule with whole backwards enters as I then W back to
back: the same timing and memory), and `pl.simulate(found, found.meta["costs"])` gives
`meta["makespan"]`.

Memory: `memory_limit` is in the unit of `costs.memory_bytes` and bounds the counted peak of
`predict/memory.py` (+M at F's end; released at B's end, or at W's end with
`weight_memory_bytes` kept from I to W), which depends only on each device's order.  Costs with
`memory_bytes` 0 everywhere count micro-batches: one micro-batch in flight is 1.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from heapq import heappop, heappush

from ..common.checks import check_counts
from ..schedules.action import Action, Kind
from ..schedules.beyond import interleaved_1f1b, zero_bubble_h1
from ..schedules.generators import gpipe, one_f_one_b
from ..schedules.schedule import Schedule
from ..schedules.validate import validate
from .costs import Costs
from .simulate import simulate

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
RULES = ("I>F>W", "F>I>W")
"""The priority orders the list scheduler tries (I: the gradient action, I or B)."""
EXTRAS = (0, 1, 2, 4, None)
"""Warm-up caps tried: stage s starts at most p - s + extra micro-batches it has not sent back (None: no cap)."""


@dataclass(frozen=True)
class _Problem:
    p: int  # devices
    m: int
    v: int  # chunks per device: p·v stages, stage k on device k mod p
    forward: list[float]  # per stage (p·v of them)
    backward: list[float]  # I's seconds, or B's (backward + weight) when nothing is split
    weight: list[float]
    links: list[float]  # links[k]: a message between stages k and k + 1 (0 on one device)
    held: list[float]  # what F adds
    for_w: list[float]  # what is left from I's end to W's end
    limit: float
    split: bool
    costs: Costs  # what `simulate` times the found schedule with


def search_schedule(n_stages: int, n_microbatches: int, costs: Costs | None = None,
                    memory_limit: float | None = None, *, n_chunks: int | tuple[int, ...] = 1,
                    exact: bool | None = None, max_nodes: int = 200_000) -> Schedule:
    """A valid schedule for `n_stages` devices (one stage each) and `n_microbatches` micro-batches that
    minimises the simulated makespan on `costs` with every device's counted memory at most `memory_limit`.

    `n_chunks`: the chunk counts v to try (an int or a tuple, e.g. (1, 2)).  v > 1 cuts the model
    into n_stages·v stages, stage k on device k mod n_stages, each taking 1/v of the costs and
    memory of stage k // v of the given costs; such a result has n_stages·v stages and
    `meta["costs"]` holds its per-stage costs.  Interleaved 1F1B then joins the named candidates.
    `exact`: True runs the branch and bound (tiny sizes: it visits at most `max_nodes` nodes, then
    stops with the best found and `meta["optimal"]` False); None (default) runs it when
    n_stages · n_microbatches ≤ 6 and v = 1; False never.  Raises ValueError when not even one
    micro-batch per stage fits.  `meta`: "makespan", "peak_memory" (per device), "idle_inside"
    (per device, idle seconds between its first action and its last), "found_by", "optimal",
    "candidates" ({name: makespan, or None where it does not fit}), "costs", "seconds".
    Among equal makespans the search keeps the one with the least idle inside, then the least memory.

    p=4, m=8, t_F = t_B = t_W = 1, free links, memory_limit=8 (2p micro-batches): ZB-H2's
    parallelogram (Zero Bubble PP, §3.1, Figure 3), every device busy from its first action
    to its last, makespan (p - 1) + 3m = 27, the lower bound:

        device 0 | F0 F1 F2 F3 F4 F5 F6 I0 F7 I1 W0 I2 W1 I3 W2 I4 W3 I5 W4 I6 W5 I7 W6 W7
        device 1 | .  F0 F1 F2 F3 F4 I0 F5 I1 F6 I2 F7 I3 W0 I4 W1 I5 W2 I6 W3 I7 W4 W5 W6 W7
        device 2 | .  .  F0 F1 F2 I0 F3 I1 F4 I2 F5 I3 F6 I4 F7 I5 W0 I6 W1 I7 W2 W3 W4 W5 W6 W7
        device 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 F5 I5 F6 I6 F7 I7 W0 W1 W2 W3 W4 W5 W6 W7
    """
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches)
    began = time.perf_counter()
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        raise TypeError(f"costs must be a pl.Costs, got {type(costs).__name__}")
    chunk_counts = (n_chunks,) if isinstance(n_chunks, int) and not isinstance(n_chunks, bool) else tuple(n_chunks)
    if not chunk_counts:
        raise ValueError("n_chunks must name at least one chunk count, like 1 or (1, 2)")
    for v in chunk_counts:
        check_counts(n_chunks=v)
    candidates: dict[str, float | None] = {}
    best: tuple | None = None  # ((makespan, idle inside, peak), name, schedule, problem)
    optimal = False
    for v in chunk_counts:
        problem = _problem(n_stages, n_microbatches, v, costs, memory_limit)
        found = [*_named(problem), *((f"list {rule} extra={extra}", _list_schedule(problem, rule, extra))
                                      for rule in RULES for extra in EXTRAS)]
        if v == 1 and (exact or (exact is None and n_stages * n_microbatches <= 6)):
            incumbent = min((_evaluate(s, problem)[0] for _, s in found if _peak(s, problem) <= problem.limit + 1e-9),
                            default=math.inf)
            exact_schedule, optimal = _exact(problem, incumbent, max_nodes)
            if exact_schedule is not None:
                found.append(("exact", exact_schedule))
        for name, schedule in found:
            label = name if v == 1 else f"{name} (v={v})"
            if _peak(schedule, problem) > problem.limit + 1e-9:
                candidates[label] = None
                continue
            makespan, idle = _evaluate(schedule, problem)
            candidates[label] = makespan
            key = (round(makespan, 9), round(idle, 9), _peak(schedule, problem))
            if best is None or key < best[0]:
                best = (key, label, schedule, problem)
    key, name, schedule, problem = best
    trace = simulate(schedule, problem.costs)
    meta = {"makespan": trace.makespan, "peak_memory": _peaks(schedule, problem), "idle_inside": _idle_inside(trace),
            "found_by": name, "optimal": optimal and len(chunk_counts) == 1,
            "candidates": candidates, "costs": problem.costs, "seconds": time.perf_counter() - began}
    return validate(Schedule(schedule.n_stages, n_microbatches, [list(row) for row in schedule.actions],
                             name="search", meta=meta))


def _evaluate(schedule: Schedule, problem: _Problem) -> tuple[float, float]:
    """(makespan, idle inside the devices' spans) of `schedule` on the simulator."""
    trace = simulate(schedule, replace(problem.costs, memory_bytes=0.0, input_bytes=0.0, weight_memory_bytes=None))
    return trace.makespan, sum(_idle_inside(trace))  # memory: `_peaks`, from the orders alone


def _idle_inside(trace) -> list[float]:
    """Per device, idle seconds between its first action's start and its last action's end."""
    first, last = {}, {}
    for e in trace.events:
        first[e.device] = min(first.get(e.device, e.start), e.start)
        last[e.device] = max(last.get(e.device, e.end), e.end)
    return [max(last[d] - first[d] - busy, 0.0) for d, busy in enumerate(trace.busy_time)]


def _peaks(schedule: Schedule, problem: _Problem) -> list[float]:
    """Per device, its counted peak (`predict/memory.py`'s rule, which depends only on the device's order)."""
    change = {_F: problem.held, _B: [-h for h in problem.held],
              _I: [w - h for w, h in zip(problem.for_w, problem.held)], _W: [-w for w in problem.for_w]}
    peaks = []
    for row in schedule.actions:
        level = peak = 0.0
        for kind, stage, _ in row:
            level += change[kind][stage]
            peak = max(peak, level)
        peaks.append(peak)
    return peaks


def _peak(schedule: Schedule, problem: _Problem) -> float:
    return max(_peaks(schedule, problem))


def _problem(p: int, m: int, v: int, costs: Costs, memory_limit: float | None) -> _Problem:
    """The search's numbers for p devices of v chunks each: chunk k takes 1/v of stage k // v's."""
    def per_stage(field: str) -> list[float]:
        return [costs.per_stage(field, k // v, p) / v for k in range(p * v)]

    forward, backward, weight = per_stage("forward"), per_stage("backward"), per_stage("weight")
    memory = per_stage("memory_bytes")
    if any(memory):
        held = memory
        for_w = held if costs.weight_memory_bytes is None else per_stage("weight_memory_bytes")
    else:
        if costs.weight_memory_bytes is not None:
            raise ValueError("Costs.weight_memory_bytes needs Costs.memory_bytes (what W keeps is a part of what "
                             "F keeps); without memory_bytes the search counts micro-batches")
        held = for_w = [1.0 / v] * (p * v)
    limit = math.inf if memory_limit is None else memory_limit
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise ValueError(f"memory_limit must be a positive number (or None), got {memory_limit!r}")
    tight = [k for k in range(p * v) if held[k] > limit]
    if tight:
        raise ValueError(f"memory_limit={memory_limit} is below what stage {tight[0]} keeps for one micro-batch "
                         f"({held[tight[0]]}): no schedule fits")
    split = any(weight)
    messages = [costs.message_seconds(k // v, p) if p > 1 else 0.0 for k in range(p * v - 1)]
    sim_costs = replace(costs, forward=forward, backward=backward, weight=weight, memory_bytes=held,
                        input_bytes=[costs.per_stage("input_bytes", k // v, p) / v for k in range(p * v)],
                        activation_bytes=[costs.per_stage("activation_bytes", k // v, p) for k in range(p * v)],
                        weight_memory_bytes=None if costs.weight_memory_bytes is None else for_w)
    if not split:
        sim_costs = replace(sim_costs, weight=0.0)
    return _Problem(p, m, v, forward, backward, weight if split else [0.0] * (p * v), messages, held, for_w,
                    float(limit), split, sim_costs)


def _named(problem: _Problem) -> list[tuple[str, Schedule]]:
    """GPipe, 1F1B, interleaved 1F1B (v > 1) — whole backwards entered as I then W when the backward is
    split — and ZB-H1."""
    p, m, v = problem.p, problem.m, problem.v
    if v > 1:
        found = [("interleaved", interleaved_1f1b(p, m, v))] if m % p == 0 else []
    else:
        found = [("gpipe", gpipe(p, m)), ("1f1b", one_f_one_b(p, m))]
    if problem.split:
        found = [(name, _split_whole_backwards(s)) for name, s in found]
        if v == 1:
            found.append(("zb-h1", zero_bubble_h1(p, m)))
    return found


def _split_whole_backwards(schedule: Schedule) -> Schedule:
    rows = [[x for a in row for x in ((Action(_I, a.stage, a.microbatch), Action(_W, a.stage, a.microbatch))
                                      if a.kind is _B else (a,))] for row in schedule.actions]
    return Schedule(schedule.n_stages, schedule.n_microbatches, rows, name=schedule.name)


def _list_schedule(problem: _Problem, rule: str, extra: int | None) -> Schedule:
    """One run of the list scheduler (module docstring, 1): events in time order, each free device
    picking by `rule`; returns the order each device ran its actions in.  A device with several
    stages prefers, among its ready forwards, the deepest stage (the micro-batch nearest the loss)."""
    p, m, v, limit = problem.p, problem.m, problem.v, problem.limit
    n = p * v
    grad_kind = _I if problem.split else _B
    f_end = [[math.inf] * m for _ in range(n)]
    next_f = [0] * n
    arrived = [[] for _ in range(p)]  # per device, a heap of (time the gradient is ready, micro-batch, stage)
    owed = [[] for _ in range(p)]  # per device, (stage, micro-batch) whose W is owed, oldest first
    level, free, started = [0.0] * p, [0.0] * p, [0] * p
    rows: list[list[Action]] = [[] for _ in range(p)]
    stages_of = [list(range(n - p + d, -1, -p)) for d in range(p)]  # deepest first
    cap = [math.inf if extra is None else (p - d + extra) * v for d in range(p)]
    whole = [sum(problem.held[k] for k in stages_of[d]) for d in range(p)]  # one micro-batch on all its chunks
    reserved = [0.0] * p  # memory promised to the later chunks of micro-batches that entered
    left = n * m * (3 if problem.split else 2)
    now, events = 0.0, []  # events: a heap of the times at which a device becomes free or a result arrives
    order = [int(c) for c in rule.replace("I", "0").replace("F", "1").replace("W", "2").split(">")]
    while left:
        for d in range(p - 1, -1, -1):
            if free[d] > now:
                continue
            choice = None
            for what in order:
                if what == 0:  # the gradient that arrived first
                    if arrived[d] and arrived[d][0][0] <= now:
                        _, i, k = arrived[d][0]
                        choice = (grad_kind, k, i)
                elif what == 1:  # a micro-batch enters the device (its first chunk) only with room for all its chunks
                    for k in stages_of[d]:
                        i = next_f[k]
                        if i >= m or (k > 0 and f_end[k - 1][i] + problem.links[k - 1] > now):
                            continue
                        if k < p and (started[d] >= cap[d] or level[d] + reserved[d] + whole[d] > limit + 1e-9):
                            continue
                        choice = (_F, k, i)
                        break
                elif owed[d]:
                    choice = (_W, *owed[d][0])
                if choice:
                    break
            if choice is None:
                continue
            kind, k, i = choice
            rows[d].append(Action(kind, k, i))
            left -= 1
            heappush(events, now + (problem.forward, problem.backward, problem.weight)[
                (_F, grad_kind, _W).index(kind)][k] + (problem.weight[k] if kind is _B else 0.0))
            if kind is _F:
                free[d] = f_end[k][i] = now + problem.forward[k]
                if k < n - 1:
                    heappush(events, free[d] + problem.links[k])  # the activation reaches stage k + 1
                next_f[k] += 1
                if k == n - 1:  # the loss's stage: its gradient is ready once its forward ends
                    heappush(arrived[d], (free[d], i, k))
                started[d] += 1
                level[d] += problem.held[k]
                reserved[d] += whole[d] - problem.held[k] if k < p else -problem.held[k]
            elif kind is _W:
                free[d] = now + problem.weight[k]
                owed[d].pop(0)
                level[d] -= problem.for_w[k]
            else:
                free[d] = now + problem.backward[k] + (0.0 if problem.split else problem.weight[k])
                if k:  # the gradient reaches stage k - 1, whose forward of i has ended
                    heappush(events, free[d] + problem.links[k - 1])
                    heappush(arrived[(k - 1) % p], (max(f_end[k - 1][i], free[d] + problem.links[k - 1]), i, k - 1))
                heappop(arrived[d])
                started[d] -= 1
                if problem.split:
                    owed[d].append((k, i))
                    level[d] += problem.for_w[k] - problem.held[k]
                else:
                    level[d] -= problem.held[k]
        while events and events[0] <= now:
            heappop(events)
        if not events:
            if left:
                raise RuntimeError(f"the list scheduler is stuck at time {now} ({rule}, extra={extra}): a bug")
            break
        now = heappop(events)  # the next moment something changes: a device is free or a result arrives
    return Schedule(n, m, rows, name=f"list {rule}")


def _exact(problem: _Problem, incumbent: float, max_nodes: int) -> tuple[Schedule | None, bool]:
    """Branch and bound over every order of every device; returns (a better schedule or None, proven).

    A set of device orders fixes every start (each action as early as its device and its inputs
    allow: what `simulate` does), so the optimum is among them.  The search appends actions in
    the order of their start times (ties: by device), so each set of orders is built exactly once:
    an action whose start would come before the last one appended is left for another branch.
    Micro-batches cost the same, so stage 0 runs its forwards in micro-batch order (any schedule
    is one of those, renumbered).  A branch is cut when its bound — per device, when it is next
    free plus the work it has left — reaches the best makespan found.  Memory is checked as each
    F is appended (a device's level depends only on its own order).
    """
    p, m = problem.p, problem.m
    kinds = (_F, _I, _W) if problem.split else (_F, _B)
    seconds = {_F: problem.forward, _I: problem.backward, _W: problem.weight,
               _B: [b + w for b, w in zip(problem.backward, problem.weight)]}
    if min(min(v) for k, v in seconds.items() if k in kinds) <= 0:
        return None, False  # zero-length actions break the start-time order; not searched
    grad = kinds[1]
    end: dict[tuple, float] = {}
    rows: list[list[Action]] = [[] for _ in range(p)]
    free, level = [0.0] * p, [0.0] * p
    work = [m * sum(seconds[k][s] for k in kinds) for s in range(p)]
    best: list = [incumbent, None]
    nodes = [0]

    def candidates(last_start: float, last_device: int):
        for d in range(p):
            done = {(a.kind, a.microbatch) for a in rows[d]}
            for i in range(m):
                for kind in kinds:
                    if (kind, i) in done:
                        continue
                    if kind is _F:
                        if d == 0 and i and (_F, i - 1) not in done:
                            break
                        if level[d] + problem.held[d] > problem.limit + 1e-9:
                            break
                        ready = 0.0 if d == 0 else end.get((_F, d - 1, i), math.inf) + problem.links[d - 1]
                    elif kind is grad:
                        ready = end.get((_F, d, i), math.inf)
                        if d < p - 1:
                            ready = max(ready, end.get((grad, d + 1, i), math.inf) + problem.links[d])
                    else:
                        ready = end.get((_I, d, i), math.inf)
                    if ready < math.inf:
                        start = max(free[d], ready)
                        if (start, d) > (last_start, last_device):
                            yield start, d, kind, i
                    break  # a micro-batch's later kinds wait for this one

    def dfs(last_start: float, last_device: int, left: int) -> None:
        nodes[0] += 1
        if nodes[0] > max_nodes:
            return
        if not left:
            makespan = max(free)
            if makespan < best[0] - 1e-9:
                best[0], best[1] = makespan, [list(r) for r in rows]
            return
        for start, d, kind, i in sorted(candidates(last_start, last_device), key=lambda c: (c[0], c[1])):
            finish = start + seconds[kind][d]
            old_free, old_level = free[d], level[d]
            free[d] = finish
            work[d] -= seconds[kind][d]
            if max(free[k] + work[k] for k in range(p)) >= best[0] - 1e-9:
                free[d] = old_free
                work[d] += seconds[kind][d]
                continue
            end[kind, d, i] = finish
            rows[d].append(Action(kind, d, i))
            level[d] += {_F: problem.held[d], _B: -problem.held[d], _I: problem.for_w[d] - problem.held[d],
                         _W: -problem.for_w[d]}[kind]
            dfs(start, d, left - 1)
            rows[d].pop()
            del end[kind, d, i]
            work[d] += seconds[kind][d]
            free[d], level[d] = old_free, old_level

    dfs(-math.inf, -1, p * m * len(kinds))
    proven = nodes[0] <= max_nodes
    if best[1] is None:
        return None, proven
    return Schedule(p, m, best[1], name="exact"), proven
