"""Every schedule at p = 4, m = 8 on the MLP: bubble and peak activations, formula / simulated / measured.

    python benchmarks/schedules_table.py [--steps 5] [--local-only]

Table 1, pipelab's schedules on `pl.models.mlp(depth=8, width=512)`, 64 samples per
micro-batch, 4 devices (interleaved: 8 stages of one block, two per device):

- bubble = idle share of the step, 1 - busy / (devices x makespan).  formula: the closed
  form at uniform costs T_F = 1, T_B = 2 (split schedules: T_B = T_W = 1), i.e.
  (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p - 1) interleaved (Megatron SC21),
  (p-1)(T_F+T_B-T_W) / (m (T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W)) for ZB-H1 (Zero Bubble PP,
  Table 2); simulated: `pl.simulate` at those costs (a consistency check of the simulator
  against the formula); local (measured): the local engine on the CPU, each action run and
  timed, each action's median over --steps steps replayed on one clock per device.
  ZB-H1 runs its W actions: B computes the input gradient only, W the weight gradients.
  distrib. (measured; left out with --local-only): the distributed engine on 4 gloo ranks,
  one process per device, the wall clock of each rank; the bubble is the median over --steps steps of the
  measured trace's.  With fewer CPU cores than ranks (the header says how many) the ranks
  share cores and every wait for a core counts as bubble: read it as this machine's figure.
- peak activations on the fullest device, in units of M_B, one micro-batch through one
  whole stage: formula m (GPipe), p (1F1B, ZB-H1, PipeDream), (v p + p - 1)/v
  (interleaved, device 0); simulated with 1 unit per stage micro-batch (1/v per chunk);
  local: the engine's counted bytes (saved-tensor hooks; a split stage holds a
  micro-batch until its W), divided by the counted bytes of one micro-batch through one
  stage (`Costs.from_profile`); distrib.: the distributed engine's, counted the same way.
- PipeDream (asynchronous) is drawn for one run of m micro-batches: its table is 1F1B's,
  and its bubble is paid once per run instead of once per optimizer step.  Measured, each
  step is a real PipeDream run (weight stashing, plain SGD per stage after every B).

Table 2: PyTorch's own tables (`pl.schedules.torch_table`) beside pipelab's schedule of
the same family, simulated at the same costs (a chunk of a two-chunk table costs half a
stage), at p = 4, m = 8 and p = 8, m = 16.  A table `validate` rejects is listed with
the reason.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import pipelab as pl
from pipelab import schedules

P, M, V = 4, 8, 2
SAMPLES_PER_MICROBATCH = 64
WIDTH = 512
T_F, T_B, T_W = 1.0, 2.0, 0.0  # whole backward
S_F, S_B, S_W = 1.0, 1.0, 1.0  # split backward


def formulas(name: str, p: int, m: int, v: int) -> tuple[float, float]:
    """(bubble fraction, peak activations in M_B) from the closed forms, uniform costs."""
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1), min(v * p + p - 1, v * m) / v
    if name == "zb-h1":
        idle = (p - 1) * (S_F + S_B - S_W)
        return idle / (m * (S_F + S_B + S_W) + idle), min(p, m)
    return (p - 1) / (m + p - 1), (m if name == "gpipe" else min(p, m))


def build(name: str, p: int, m: int, v: int) -> tuple[pl.Schedule, pl.Costs]:
    """The schedule and its uniform costs (a chunk of an interleaved model costs 1/v of a stage)."""
    if name == "interleaved":
        # one memory unit per chunk-micro-batch (memory samples are whole bytes): divide the peak by v
        return schedules.interleaved_1f1b(p, m, v), pl.Costs(T_F / v, T_B / v, memory_bytes=1.0)
    if name == "zb-h1":
        return schedules.zero_bubble_h1(p, m), pl.Costs(S_F, S_B, S_W, memory_bytes=1.0)
    return schedules.by_name(name, p, m), pl.Costs(T_F, T_B, memory_bytes=1.0)


def optimizer_for(schedule: pl.Schedule):
    """Asynchronous PipeDream updates during the step: plain SGD per stage (its time is inside each B)."""
    return (lambda params: torch.optim.SGD(params, lr=1e-3)) if schedule.asynchronous else None


def model_and_batch():
    model = pl.models.mlp(depth=8, width=WIDTH, seed=0)
    return model, pl.models.sample_batch(model, M * SAMPLES_PER_MICROBATCH)


def distributed_steps(schedules_to_run: list[pl.Schedule], steps: int) -> list[tuple[float, float]]:
    """On every rank (pl.distributed.launch): `steps` steps of each schedule after one warm-up step;
    (median measured bubble, counted peak bytes on the fullest device) per schedule."""
    found = []
    for schedule in schedules_to_run:
        model, (x, y) = model_and_batch()
        pipe = pl.DistributedPipeline(model, n_microbatches=M, schedule=schedule, loss_fn=torch.nn.MSELoss(),
                                      optimizer=optimizer_for(schedule))
        pipe.step(x, y)
        bubbles, peak = [], 0
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            trace = pipe.step(x, y).trace
            bubbles.append(trace.bubble_fraction)
            peak = max(trace.peak_memory)
        found.append((statistics.median(bubbles), peak))
    return found


def measure(schedule: pl.Schedule, x, y, steps: int, unit_bytes: float) -> tuple[float, float]:
    """(bubble, peak in M_B) on the local engine.

    The bubble replays each action's median duration over `steps` steps (pl.simulate with
    a {action: seconds} map): on a shared CPU single actions get preempted for several
    times their length, and a median per action drops those outliers.
    """
    model = pl.models.mlp(depth=8, width=WIDTH, seed=0)
    pipe = pl.Pipeline(model, n_stages=schedule.n_stages, n_microbatches=M, schedule=schedule,
                       loss_fn=torch.nn.MSELoss(), devices="cpu",
                       optimizer=optimizer_for(schedule))
    traces = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        traces.append(pipe.step(x, y).trace)
    medians = {a: statistics.median(t.durations()[a] for t in traces) for a in schedule.all_actions()}
    return pl.simulate(schedule, medians).bubble_fraction, max(traces[-1].peak_memory) / unit_bytes


SCHEDULES = (("gpipe", "GPipe"), ("1f1b", "1F1B"), ("interleaved", f"interleaved 1F1B v={V}"),
             ("zb-h1", "ZB-H1"), ("pipedream-async", "PipeDream (one run)"))


def pipelab_table(steps: int, distributed: bool) -> None:
    model, (x, y) = model_and_batch()
    parts = pl.split(model, P, "uniform")
    chunk = (x[:SAMPLES_PER_MICROBATCH], y[:SAMPLES_PER_MICROBATCH])
    unit_bytes = statistics.mean(pl.Costs.from_profile(model, parts, chunk, torch.nn.MSELoss()).memory_bytes)
    built = {name: build(name, P, M, V) for name, _ in SCHEDULES}
    on_ranks = {}
    if distributed:
        found = pl.distributed.launch(distributed_steps, P, [built[name][0] for name, _ in SCHEDULES], steps,
                                      timeout_seconds=600)[0]
        on_ranks = {name: (bubble, peak / unit_bytes) for (name, _), (bubble, peak) in zip(SCHEDULES, found)}
    print(f"Table 1: p = {P}, m = {M}, MLP 8 x {WIDTH}, {SAMPLES_PER_MICROBATCH} samples per micro-batch; "
          f"M_B = {unit_bytes / 1024:.0f} KiB counted; local = local engine on CPU, median per action of {steps} "
          f"steps, replayed" + (f"; distributed = {P} gloo ranks on {os.cpu_count()} CPU cores, wall clock, median "
                                f"of {steps} steps" if distributed else ""))
    extra = f" {'distrib.':>9}" if distributed else ""
    header = (f"{'schedule':<22} {'bubble: formula':>15} {'simulated':>10} {'local':>9}{extra}   "
              f"{'peak M_B: formula':>17} {'simulated':>10} {'local':>9}{extra}")
    print(header)
    print("-" * len(header))
    for name, label in SCHEDULES:
        bubble, peak = formulas(name, P, M, V)
        schedule, costs = built[name]
        trace = pl.simulate(schedule, costs)
        simulated_peak = max(trace.peak_memory) / (V if name == "interleaved" else 1)
        local_bubble, local_peak = measure(schedule, x, y, steps, unit_bytes)
        ranks = ((f" {on_ranks[name][0]:9.3f}", f" {on_ranks[name][1]:9.2f}") if distributed else ("", ""))
        print(f"{label:<22} {bubble:15.3f} {trace.bubble_fraction:10.3f} {local_bubble:9.3f}{ranks[0]}   "
              f"{peak:17.2f} {simulated_peak:10.2f} {local_peak:9.2f}{ranks[1]}")


TORCH_BESIDE = (("GPipe", 1, "gpipe"), ("1F1B", 1, "1f1b"), ("Interleaved1F1B", 2, "interleaved"),
                ("LoopedBFS", 2, "interleaved"), ("InterleavedZeroBubble", 2, "zb-h1"),
                ("ZBVZeroBubble", 2, "zb-h1"), ("DualPipeV", 2, "zb-h1"))


def torch_table(p: int, m: int) -> None:
    print(f"\nTable 2: PyTorch's tables beside pipelab's, simulated, p = {p}, m = {m} "
          f"(whole backward T_F={T_F:g}, T_B={T_B:g}; split T_F=T_B=T_W={S_F:g}; a chunk costs 1/chunks)")
    header = f"{'PyTorch schedule':<22} {'makespan':>9} {'bubble':>7}   {'pipelab':<22} {'makespan':>9} {'bubble':>7}"
    print(header)
    print("-" * len(header))
    for torch_name, chunks, family in TORCH_BESIDE:
        ours, our_costs = build(family, p, m, V)
        ours_trace = pl.simulate(ours, our_costs)
        table = schedules.torch_schedule(torch_name, p, m, n_chunks=chunks)
        split = any(a.kind == "W" for a in table.all_actions())
        costs = (pl.Costs(S_F / chunks, S_B / chunks, S_W / chunks) if split
                 else pl.Costs(T_F / chunks, T_B / chunks))
        try:
            schedules.validate(table)
            trace = pl.simulate(table, costs)
            left = f"{trace.makespan:9.2f} {trace.bubble_fraction:7.3f}"
        except pl.ScheduleError as error:
            left = f"rejected: {str(error)[:60]}"
        print(f"{torch_name + f' (x{chunks})':<22} {left:>17}   {ours.name:<22} {ours_trace.makespan:9.2f} "
              f"{ours_trace.bubble_fraction:7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per schedule (the median is shown)")
    parser.add_argument("--local-only", action="store_true",
                        help=f"leave out the distributed engine's column ({P} gloo ranks, about 10 s)")
    args = parser.parse_args()
    pipelab_table(args.steps, distributed=not args.local_only)
    for p, m in ((P, M), (8, 16)):
        torch_table(p, m)


if __name__ == "__main__":
    main()
