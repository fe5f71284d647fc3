"""Peak activation bytes per stage: predicted, counted and observed; what checkpointing costs in time.

    python benchmarks/memory_report.py

Three figures per stage, never confused (DESIGN.md, "Measuring memory honestly"):

- predicted: the simulator fed from `Costs.from_profile` (bytes saved per micro-batch);
- counted: the engine's curve by the same rule from its own saved-bytes counts; predicted
  = counted is a consistency check, not a measurement;
- observed: when PyTorch really freed each storage a stage kept (`runtime/memory_observer.py`),
  the measurement to compare predictions with.  Its gap over the saved tensors is broken
  down by reason at the observed peak: the output of the running forward until sent
  ("output"), messages received and not yet used ("received": gradients waiting for their
  B, activations for their F), a gradient computed and not yet sent ("gradient").

1. Lesson 04's setting (MLP 8 x 256, batch 64, p = 4, m = 8): GPipe, 1F1B, 1F1B with
   checkpointing; observed over 5 steps (it depends on the measured durations the step is
   replayed with: a slow action lets messages pile up), and what keeping every stage
   output until its backward would cost (before outputs were freed after the send).
2. The same on real processes (distributed engine, gloo): gloo keeps a sent tensor until
   the send is waited for, at the end of the step.
3. MLP 8 x 512, 32 samples per micro-batch, m in {4, 8, 16}: counted vs predicted (the
   consistency check) and observed / predicted.
4. The time cost of checkpointing: median makespan with / without (1F1B, m = 8) against
   the simulator's ratio (model: each B grows by one F; Chen et al. 2016 report ~30 %).
5. Zero-bubble memory (ZB-H1 against 1F1B, a GPT with 48-token sequences, p = 3, m = 6):
   per stage M_B (what F saved), M_W (what waits from I to W), the counted and observed
   peaks, the bound p·M_B, and the Zero Bubble paper's M_W / M_B = 32 / (34 + 5as/h).
"""

from __future__ import annotations

import statistics

import torch

import pipelab as pl

SETTINGS = [("gpipe", "never"), ("1f1b", "never"), ("1f1b", "always")]
KiB = 1024


def kib(n: float) -> str:
    return f"{n / KiB:7.1f}"


def label(schedule: str, checkpoint: str) -> str:
    return schedule + (" + checkpoint" if checkpoint != "never" else "")


def gap_explained(parts: dict[str, int]) -> str:
    """The observed peak beyond the saved tensors (and the inputs a checkpointed stage keeps), by reason."""
    extra = {why: b for why, b in parts.items() if why not in ("saved", "input")}
    return ", ".join(f"{why} {b / KiB:g}" if b >= KiB else f"{why} {b} B" for why, b in extra.items()) or "-"


def predicted_trace(model, pipe, x, y, samples, loss_fn, checkpoint):
    costs = pl.Costs.from_profile(model, pipe.partition, (x[:samples], y[:samples]), loss_fn, repeats=1)
    return pl.simulate(pipe.schedule, costs, checkpoint=checkpoint)


def lesson_04_setting() -> None:
    p, m, batch = 4, 8, 64
    model = pl.models.mlp(depth=8, width=256, seed=0)
    loss_fn = torch.nn.MSELoss()
    x, y = pl.models.sample_batch(model, batch)
    print(f"1. lesson 04's setting: MLP 8 x 256, batch {batch}, p = {p}, m = {m}  (KiB; observed: 5 steps, "
          "range and the last step's gap over the saved tensors)")
    print(f"{'schedule':<18} stage {'predicted':>9} {'counted':>8} {'observed':>16} {'obs/pred':>9}   "
          f"gap at the observed peak (KiB)")
    for schedule, checkpoint in SETTINGS:
        pipe = pl.Pipeline(model, n_stages=p, n_microbatches=m, schedule=schedule, loss_fn=loss_fn, devices="cpu",
                           checkpoint=checkpoint)
        traces = [pipe.step(x, y).trace for _ in range(5)]
        model.zero_grad(set_to_none=True)
        predicted = predicted_trace(model, pipe, x, y, batch // m, loss_fn, checkpoint).peak_memory
        last = traces[-1]
        for s in range(p):
            observed = [t.peak_memory_observed[s] for t in traces]
            low, high = min(observed), max(observed)
            span = f"{low / KiB:.1f}" + (f"-{high / KiB:.1f}" if high != low else "")
            print(f"{label(schedule, checkpoint) if s == 0 else '':<18} {s:>5} {kib(predicted[s]):>9} "
                  f"{kib(last.peak_memory[s]):>8} {span:>16} {statistics.median(observed) / predicted[s]:9.2f}   "
                  f"{gap_explained(last.observed_peak_parts[s])}")


def ranks_step(schedule: str) -> tuple:
    """On every rank: two steps of lesson 04's MLP; the second's counted and observed peaks, and the gap."""
    model = pl.models.mlp(depth=8, width=256, seed=0)
    x, y = pl.models.sample_batch(model, 64)
    pipe = pl.DistributedPipeline(model, n_microbatches=8, schedule=schedule, loss_fn=torch.nn.MSELoss())
    trace = [pipe.step(x, y).trace for _ in range(2)][-1]
    return trace.peak_memory, trace.peak_memory_observed, trace.observed_peak_parts


def on_processes() -> None:
    print("\n2. the same on 4 processes (distributed engine, gloo), second step  (KiB)")
    print(f"{'schedule':<8} stage {'counted':>8} {'observed':>9}   gap at the observed peak (KiB)")
    for schedule in ("gpipe", "1f1b"):
        counted, observed, parts = pl.distributed.launch(ranks_step, 4, schedule, timeout_seconds=300)[0]
        for s in range(4):
            print(f"{schedule if s == 0 else '':<8} {s:>5} {kib(counted[s]):>8} {kib(observed[s]):>9}   "
                  f"{gap_explained(parts[s])}")


def sweep() -> None:
    samples = 32
    loss_fn = torch.nn.MSELoss()
    print(f"\n3. MLP 8 x 512, {samples} samples per micro-batch, p = 4: counted / predicted (the consistency check) "
          "and observed / predicted, per stage")
    print(f"{'schedule':<18} {'m':>3}  {'counted vs predicted':<22} observed / predicted")
    worst = 0.0
    for m in (4, 8, 16):
        model = pl.models.mlp(depth=8, width=512, seed=0)
        x, y = pl.models.sample_batch(model, m * samples)
        for schedule, checkpoint in SETTINGS:
            pipe = pl.Pipeline(model, n_stages=4, n_microbatches=m, schedule=schedule, loss_fn=loss_fn, devices="cpu",
                               checkpoint=checkpoint)
            trace = pipe.step(x, y).trace
            model.zero_grad(set_to_none=True)
            predicted = predicted_trace(model, pipe, x, y, samples, loss_fn, checkpoint).peak_memory
            errors = [abs(c / q - 1) if q else 0.0 for c, q in zip(trace.peak_memory, predicted)]
            worst = max(worst, max(errors))
            ratios = "  ".join(f"{o / q:5.2f}" for o, q in zip(trace.peak_memory_observed, predicted))
            print(f"{label(schedule, checkpoint):<18} {m:>3}  worst {max(errors):6.1%}{'':<9} {ratios}")
    print(f"counted vs predicted, worst: {worst:.1%} (the same rule on the same counts: a consistency check)")


def checkpoint_time_cost() -> None:
    samples = 32
    loss_fn = torch.nn.MSELoss()
    model = pl.models.mlp(depth=8, width=512, seed=0)
    x, y = pl.models.sample_batch(model, 8 * samples)
    plans = ("never", "always")
    pipes = {c: pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=loss_fn, devices="cpu",
                            checkpoint=c) for c in plans}
    runs = {c: [] for c in plans}
    for _ in range(9):  # alternate the two so that a burst of load on this shared machine hits both alike
        for c in plans:
            runs[c].append(pipes[c].step(x, y).trace.makespan)
    makespans = {c: statistics.median(runs[c][1:]) for c in plans}  # the first step of each warms up
    costs = pl.Costs.from_profile(model, pipes["never"].partition, (x[:samples], y[:samples]), loss_fn, repeats=9)
    predicted = {c: pl.simulate(pipes[c].schedule, costs, checkpoint=c).makespan for c in plans}
    print(f"\n4. checkpointing time cost (1F1B, p=4, m=8): measured step x{makespans['always'] / makespans['never']:.2f} "
          f"({makespans['never'] * 1e3:.1f} -> {makespans['always'] * 1e3:.1f} ms, median of 8), "
          f"simulated x{predicted['always'] / predicted['never']:.2f}")


def zero_bubble_memory() -> None:
    p, m, heads, seq, width = 3, 6, 4, 48, 16
    model = pl.models.tiny_gpt(n_layers=4, d_model=width, n_heads=heads, vocab_size=32, seq_len=seq, seed=1)
    x, y = pl.models.sample_batch(model, 2 * m)
    runs = {}
    for schedule in ("1f1b", "zb-h1"):
        pipe = pl.Pipeline(model, n_stages=p, n_microbatches=m, schedule=schedule,
                           loss_fn=pl.models.default_loss(model), devices="cpu")
        runs[schedule] = (pipe.step(x, y).trace, pipe.workers)
        model.zero_grad(set_to_none=True)
    zb, workers = runs["zb-h1"]
    paper = 32 / (34 + 5 * heads * seq / width)
    print(f"\n5. zero-bubble memory: GPT 4 layers, h = {width}, a = {heads}, s = {seq}, p = {p}, m = {m}  (KiB; "
          f"the paper's M_W / M_B here: {paper:.2f})")
    print(f"{'stage':>5} {'M_B':>8} {'M_W':>8} {'M_W/M_B':>8} {'1F1B counted':>13} {'ZB-H1 counted':>14} "
          f"{'ZB-H1 observed':>15} {'p M_B':>8}")
    for s in range(p):
        m_b, m_w = max(workers[s].saved_bytes.values()), max(workers[s].for_w_bytes.values())
        print(f"{s:>5} {kib(m_b):>8} {kib(m_w):>8} {m_w / m_b:8.2f} {kib(runs['1f1b'][0].peak_memory[s]):>13} "
              f"{kib(zb.peak_memory[s]):>14} {kib(zb.peak_memory_observed[s]):>15} {kib(p * m_b):>8}")
    print("stage 0 starts from token ids: no input gradient, its W runs the whole backward, nothing leaves at I")


def main() -> None:
    torch.set_num_threads(1)
    lesson_04_setting()
    on_processes()
    sweep()
    checkpoint_time_cost()
    zero_bubble_memory()


if __name__ == "__main__":
    main()
