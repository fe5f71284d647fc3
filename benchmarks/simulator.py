"""Simulator figures: throughput, explorer update time, and predicted vs measured makespan.

    python benchmarks/simulator.py

1. Throughput: `pl.simulate` of 1F1B at p=64, m=1024 (131,072 actions), validation
   included; target >= 500k actions/s.
2. Explorer slider change at p=16, m=64: simulate, draw the timeline and the memory panel,
   encode both PNGs: target <= 100 ms median in the kernel (moving m, and moving p); also at
   p=4, and the same pictures as new figures each time (how the explorer drew before).
3. Prediction: the MLP at p=4, m=8 on the CPU, makespan predicted from profiled costs
   (`Costs.from_profile` on one micro-batch) vs the measured (replayed) makespan; target
   within 10 %.  Profiling and measuring alternate (see `prediction`), one torch thread.
All figures from this one run.
"""

from __future__ import annotations

import statistics
import time

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

import pipelab as pl  # noqa: E402
from pipelab.common.gc_pause import gc_paused  # noqa: E402
from pipelab.show.widgets import ExplorerPanels, _png, explorer_figures, explorer_pictures, explorer_view  # noqa: E402


def throughput(repeats: int = 5) -> float:
    schedule = pl.schedules.one_f_one_b(64, 1024)
    n_actions = len(schedule.all_actions())
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        trace = pl.simulate(schedule, pl.Costs(1.0, 2.0))
        seconds.append(time.perf_counter() - begin)
        del trace  # freeing the result (about 10 % more) is the caller's business, after the timer
    rate = n_actions / min(seconds)
    print(f"1. simulator: 1F1B p=64 m=1024, {n_actions} actions in {min(seconds) * 1e3:.0f} ms (best of {repeats}) "
          f"= {rate / 1e3:.0f}k actions/s (target >= 500k: {'met' if rate >= 5e5 else 'NOT met'}); "
          f"median {n_actions / statistics.median(seconds) / 1e3:.0f}k actions/s")
    return rate


def explorer_update(repeats: int = 15) -> None:
    """One slider change, as the explorer computes it: simulate, then draw the timeline and the memory
    panel into the figures it keeps and encode both PNGs, nothing remembered.  Each case alternates
    two values, so every change really redraws: the micro-batches slider at p=16 (m 63 <-> 64: the
    figures keep their rows) and at p=4, the devices slider (p 15 <-> 16 at m=64: new rows, all
    drawn).  Printed: the median wall clock and CPU time of this process; alternated with it, the
    same pictures drawn as new figures (the explorer before it kept its figures)."""
    cases = [("m", 16, [(16, 63), (16, 64)]), ("p", 16, [(15, 64), (16, 64)]), ("m", 4, [(4, 7), (4, 8)])]
    for slider, p, values in cases:
        panels = ExplorerPanels(cached=0)
        wall, cpu, new_figures = [], [], []
        for k in range(repeats):
            n_devices, n_microbatches = values[k % 2]
            begin, begin_cpu = time.perf_counter(), time.process_time()
            for _ in explorer_pictures(explorer_view(n_devices, n_microbatches, "1f1b"), panels):
                pass
            wall.append(time.perf_counter() - begin)
            cpu.append(time.process_time() - begin_cpu)
            begin = time.perf_counter()
            with gc_paused(collect_young=True):
                for fig in explorer_figures(explorer_view(n_devices, n_microbatches, "1f1b")):
                    _png(fig)
            new_figures.append(time.perf_counter() - begin)
        median = statistics.median(wall)
        target = f" (target <= 100 ms: {'met' if median <= 0.100 else 'NOT met'})" if p == 16 else ""
        moved = f"m {values[0][1]} <-> {values[1][1]}" if slider == "m" else f"p {values[0][0]} <-> {values[1][0]}"
        print(f"2. explorer slider change at p={p}, m={values[1][1]} ({moved}; simulate, timeline + memory panel, "
              f"PNGs): median {median * 1e3:.0f} ms wall, {statistics.median(cpu) * 1e3:.0f} ms CPU over {repeats}"
              f"{target}; drawn as new figures each time {statistics.median(new_figures) * 1e3:.0f} ms")


def prediction(rounds: int = 9, repeats: int = 3) -> float:
    """Profiled costs predict the measured makespan; `repeats` independent estimates, their median.

    Each estimate alternates `rounds` times: profile the stages (`Costs.from_profile`, best of
    3 runs of each op), run one pipelined step.  The prediction uses each stage's median profiled
    time, the measurement the median step: both sample the same seconds of this VM, whose speed
    swings from one second to the next (profiling all first and measuring after gave errors from
    -17 % to +25 % on a bad day; profiling single runs read about 10 % high, the ops still cold).
    """
    torch.set_num_threads(1)  # one core per run: two spinning threads on a shared 2-core machine wreck timings
    model = pl.models.mlp(depth=8, width=512, seed=0)
    x, y = pl.models.sample_batch(model, 8 * 32)
    loss_fn = torch.nn.MSELoss()
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=loss_fn, devices="cpu")
    pipe.step(x, y)
    errors = []
    for _ in range(repeats):
        profiles, steps = [], []
        for _ in range(rounds):
            profiles.append(pl.Costs.from_profile(model, pipe.partition, (x[:32], y[:32]), loss_fn, repeats=3))
            steps.append(pipe.step(x, y).trace.makespan)
        costs = pl.Costs(forward=[statistics.median(c.forward[s] for c in profiles) for s in range(4)],
                         backward=[statistics.median(c.backward[s] for c in profiles) for s in range(4)])
        predicted, measured = pl.simulate(pipe.schedule, costs).makespan, statistics.median(steps)
        errors.append(predicted / measured - 1)
    error = statistics.median(errors)
    print(f"3. prediction: MLP 8x512, p=4 m=8 1F1B on CPU: last estimate predicted {predicted * 1e3:.1f} ms, "
          f"measured {measured * 1e3:.1f} ms; errors {', '.join(f'{e:+.1%}' for e in errors)}, median {error:+.1%} "
          f"(target within 10 %: {'met' if abs(error) <= 0.10 else 'NOT met'})")
    return error


if __name__ == "__main__":
    throughput()
    explorer_update()
    prediction()
