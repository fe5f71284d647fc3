"""Measured vs predicted peak activation bytes per stage, and what checkpointing costs in time.

    python benchmarks/memory_report.py

The MLP (depth 8, width 512, 32 samples per micro-batch) at p = 4, m in {4, 8, 16}: for
GPipe, 1F1B and 1F1B with activation checkpointing, each stage's peak activation bytes
measured by the local engine (autograd saved-tensor hooks) and predicted by the
simulator fed from `Costs.from_profile` (target: within 10 %).  Then the time cost of
checkpointing: median step makespan with / without (1F1B, m = 8), against the
simulator's ratio (model: each B grows by one F; Chen et al. 2016 report ~30 %).
"""

from __future__ import annotations

import statistics

import torch

import pipelab as pl

SAMPLES_PER_MICROBATCH = 32
SETTINGS = [("gpipe", "never"), ("1f1b", "never"), ("1f1b", "always")]


def kib(n: float) -> str:
    return f"{n / 1024:9.1f}"


def main() -> None:
    torch.set_num_threads(1)
    loss_fn = torch.nn.MSELoss()
    print("peak activation KiB per stage: measured / predicted (p = 4, MLP 8 x 512, 32 samples per micro-batch)")
    print(f"{'schedule':<18} {'m':>3}  " + "  ".join(f"{'stage ' + str(s):>21}" for s in range(4)) + "   worst error")
    worst_overall = 0.0
    for m in (4, 8, 16):
        model = pl.models.mlp(depth=8, width=512, seed=0)
        x, y = pl.models.sample_batch(model, m * SAMPLES_PER_MICROBATCH)
        for schedule, checkpoint in SETTINGS:
            pipe = pl.Pipeline(model, 4, m, schedule, loss_fn, devices="cpu", checkpoint=checkpoint)
            measured = pipe.step(x, y).trace.peak_memory
            costs = pl.Costs.from_profile(model, pipe.partition, (x[:SAMPLES_PER_MICROBATCH], y[:SAMPLES_PER_MICROBATCH]),
                                          loss_fn, repeats=1)
            predicted = pl.simulate(pipe.schedule, costs, checkpoint=checkpoint).peak_memory
            errors = [abs(p / q - 1) if q else 0.0 for p, q in zip(predicted, measured)]
            worst_overall = max(worst_overall, max(errors))
            label = schedule + (" + checkpoint" if checkpoint != "never" else "")
            cells = "  ".join(f"{kib(a)} /{kib(b)}" for a, b in zip(measured, predicted))
            print(f"{label:<18} {m:>3}  {cells}   {max(errors):6.1%}")
            model.zero_grad(set_to_none=True)
    print(f"worst prediction error: {worst_overall:.1%} (target <= 10 %: {'met' if worst_overall <= 0.10 else 'NOT met'})")

    model = pl.models.mlp(depth=8, width=512, seed=0)
    x, y = pl.models.sample_batch(model, 8 * SAMPLES_PER_MICROBATCH)
    plans = ("never", "always")
    pipes = {c: pl.Pipeline(model, 4, 8, "1f1b", loss_fn, devices="cpu", checkpoint=c) for c in plans}
    runs = {c: [] for c in plans}
    for _ in range(9):  # alternate the two so that a burst of load on this shared machine hits both alike
        for c in plans:
            runs[c].append(pipes[c].step(x, y).trace.makespan)
    makespans = {c: statistics.median(runs[c][1:]) for c in plans}  # the first step of each warms up
    costs = pl.Costs.from_profile(model, pipes["never"].partition,
                                  (x[:SAMPLES_PER_MICROBATCH], y[:SAMPLES_PER_MICROBATCH]), loss_fn, repeats=9)
    predicted = {c: pl.simulate(pipes[c].schedule, costs, checkpoint=c).makespan for c in plans}
    print(f"\ncheckpointing time cost (1F1B, p=4, m=8): measured step x{makespans['always'] / makespans['never']:.2f} "
          f"({makespans['never'] * 1e3:.1f} -> {makespans['always'] * 1e3:.1f} ms, median of 8), "
          f"simulated x{predicted['always'] / predicted['never']:.2f}")


if __name__ == "__main__":
    main()
