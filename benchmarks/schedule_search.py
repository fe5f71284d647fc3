"""`pl.search_schedule` against the named schedules, on a grid of sizes, costs, links and memory limits.

    .venv/bin/python benchmarks/schedule_search.py [--quick]

The grid: p in (2, 4, 8); m in (p, 2p, 4p); t_F : t_B : t_W in (1:1:1, 1:2:1, 1:1:0.5, 2:3:1)
(t_B the input-gradient half, as in Zero Bubble PP; a whole backward costs t_B + t_W); link latency
in (0, 0.1, 0.5) x t_F; memory limit in (p, 1.5p, 2p, unlimited) micro-batches, per device.  For
each case every named schedule is simulated on the same work:

- GPipe and 1F1B, whole backwards (B takes t_B + t_W);
- ZB-H1, split backwards (I takes t_B, W takes t_W);
- interleaved 1F1B with v = 2 (m a multiple of p): each stage cut in two chunks, each chunk half
  the time and half the memory of a stage, and a message (latency) at every chunk boundary.

Memory is counted in half micro-batches (`memory_bytes=2` a stage, 1 a chunk) so the interleaved
peak is exact.  A named schedule "fits" when every device's counted peak is at most the limit.

Printed: per p, the cases, how often the search is strictly better than the best named schedule
that fits (better by more than 1e-9 of the makespan), never worse (asserted; it holds by
construction, as the search also evaluates GPipe, 1F1B and ZB-H1; interleaved it does not build),
and the largest gain; the same count for the search with one chunk per device (n_chunks=1) against
GPipe, 1F1B and ZB-H1; then the ZB-H2 check (equal unit costs, free links, limit 2p: the makespan
is (p - 1) t_F + m (t_F + t_B + t_W), every device busy from its first action to its last) and the
search's time at p = 8, m = 32 (target < 2 s).  About a minute on one core.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from itertools import product

import pipelab as pl
from pipelab import schedules

RATIOS = ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5), (2.0, 3.0, 1.0))
LATENCIES = (0.0, 0.1, 0.5)
UNIT = 2  # memory units per micro-batch of a whole stage (a chunk of interleaved 1F1B v=2 keeps 1)


def named(p: int, m: int, t_f: float, t_b: float, t_w: float, latency: float) -> dict[str, tuple[float, float]]:
    """{name: (makespan, peak memory in micro-batches)} of each named schedule on this work."""
    whole = pl.Costs(forward=t_f, backward=t_b + t_w, latency=latency, memory_bytes=UNIT)
    split = pl.Costs(forward=t_f, backward=t_b, weight=t_w, latency=latency, memory_bytes=UNIT)
    chunk = pl.Costs(forward=t_f / 2, backward=(t_b + t_w) / 2, latency=latency, memory_bytes=UNIT // 2)
    runs = {"gpipe": (schedules.gpipe(p, m), whole), "1f1b": (schedules.one_f_one_b(p, m), whole),
            "zb-h1": (schedules.zero_bubble_h1(p, m), split)}
    if m % p == 0:
        runs["interleaved v=2"] = (schedules.interleaved_1f1b(p, m, 2), chunk)
    found = {}
    for name, (schedule, costs) in runs.items():
        trace = pl.simulate(schedule, costs)
        found[name] = (trace.makespan, max(trace.peak_memory) / UNIT)
    return found


def run_case(p, m, ratio, latency, limit, chunks=(1, 2)):
    """(found makespan, best named that fits, its makespan, seconds, found by) for one case; with chunks=1
    the search builds one stage per device and is compared with GPipe, 1F1B and ZB-H1 only."""
    t_f, t_b, t_w = ratio
    costs = pl.Costs(forward=t_f, backward=t_b, weight=t_w, latency=latency, memory_bytes=UNIT)
    began = time.perf_counter()
    found = pl.search_schedule(p, m, costs, memory_limit=None if limit is None else limit * UNIT, n_chunks=chunks)
    seconds = time.perf_counter() - began
    trace = pl.simulate(schedules.validate(found), found.meta["costs"])
    assert limit is None or max(trace.peak_memory) <= limit * UNIT, (p, m, ratio, latency, limit)
    assert math.isclose(trace.makespan, found.meta["makespan"])
    fits = {name: span for name, (span, peak) in named(p, m, t_f, t_b, t_w, latency).items()
            if (limit is None or peak <= limit + 1e-9) and (chunks != 1 or not name.startswith("interleaved"))}
    best_name = min(fits, key=fits.get) if fits else None
    return trace.makespan, best_name, fits.get(best_name), seconds, found.meta["found_by"]


def zb_h2_check(p: int, m: int) -> tuple[float, float, bool]:
    costs = pl.Costs(forward=1.0, backward=1.0, weight=1.0)
    found = pl.search_schedule(p, m, costs, memory_limit=2 * p)
    trace = pl.simulate(found, costs)
    no_gap = all(abs(sum(e.duration for e in trace.events if e.device == d)
                     - (max(e.end for e in trace.events if e.device == d)
                        - min(e.start for e in trace.events if e.device == d))) < 1e-9 for d in range(p))
    return trace.makespan, (p - 1) + 3 * m, no_gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p in (2, 4) only")
    args = parser.parse_args()
    sizes = (2, 4) if args.quick else (2, 4, 8)
    print(f"{'p':>2} {'cases':>5} {'better':>6} {'worse':>5} {'no named fits':>13} {'largest gain':>12}  "
          f"{'slowest search':>14}")
    total = better_total = better_one = 0
    winners: Counter = Counter()
    for p in sizes:
        cases = better = worse = unfit = 0
        gain, slowest = 0.0, 0.0
        for m_factor, ratio, latency, limit_factor in product((1, 2, 4), RATIOS, LATENCIES, (1, 1.5, 2, None)):
            m = m_factor * p
            limit = None if limit_factor is None else math.floor(limit_factor * p)
            makespan, best_name, best, seconds, found_by = run_case(p, m, ratio, latency, limit)
            winners[found_by.split(" extra")[0].replace(" (v=2)", "") + (" (v=2)" if "v=2" in found_by else "")] += 1
            one_chunk, _, best_one, _, _ = run_case(p, m, ratio, latency, limit, chunks=1)
            better_one += best_one is not None and one_chunk < best_one * (1 - 1e-9)
            assert best_one is None or one_chunk <= best_one * (1 + 1e-9)
            slowest = max(slowest, seconds)
            cases += 1
            if best is None:
                unfit += 1
                continue
            if makespan < best * (1 - 1e-9):
                better += 1
                gain = max(gain, 1 - makespan / best)
            elif makespan > best * (1 + 1e-9):
                worse += 1
                print(f"  worse: p={p} m={m} ratio={ratio} latency={latency} limit={limit}: "
                      f"{makespan:.3f} vs {best_name} {best:.3f}")
        total += cases
        better_total += better
        print(f"{p:>2} {cases:>5} {better:>6} {worse:>5} {unfit:>13} {gain:>11.1%}  {slowest:>13.3f}s")
    print(f"all: {better_total} of {total} cases strictly better than the best named schedule that fits "
          f"({better_total / total:.0%}; target >= 33%)")
    print(f"one chunk per device (n_chunks=1) against GPipe, 1F1B and ZB-H1: {better_one} of {total} strictly "
          f"better ({better_one / total:.0%}), never worse")
    print("found by: " + ", ".join(f"{name} {count}" for name, count in winners.most_common()))
    for p, m in ((4, 8), (4, 16), (8, 32)):
        makespan, ideal, no_gap = zb_h2_check(p, m)
        print(f"ZB-H2 check p={p} m={m} (unit costs, limit 2p): makespan {makespan:g}, "
              f"(p-1) t_F + m (t_F+t_B+t_W) = {ideal:g}, no idle gap on any device: {no_gap}")
    costs = pl.Costs(forward=1.0, backward=2.0, weight=1.0, latency=0.1)
    for chunks in (1, (1, 2)):
        began = time.perf_counter()
        found = pl.search_schedule(8, 32, costs, memory_limit=16, n_chunks=chunks)
        print(f"p=8, m=32 (1:2:1, latency 0.1, limit 16, n_chunks={chunks}): {time.perf_counter() - began:.2f} s "
              f"(target < 2 s), makespan {found.meta['makespan']:g}, found by {found.meta['found_by']}")


if __name__ == "__main__":
    main()
