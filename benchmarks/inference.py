"""Pipelined inference: latency and throughput against p and m, simulated and measured, in one table;
then on real processes beside PyTorch's own forward-only schedule.

    .venv/bin/python benchmarks/inference.py          # about a minute on 2 cores

1. The local engine, `pl.Pipeline.infer` (forward only, E actions, `pl.schedules.inference`):
   `pl.models.mlp(depth=8, width=512)`, a batch of 256, p in {1, 2, 4, 8} stages, m in
   {1, 4, 16} micro-batches.  "simulated": `pl.simulate` on `pl.Costs.from_profile` of one
   micro-batch (best of 5); "measured": 5 passes on the engine, each op's median duration
   replayed on one clock per stage (a shared CPU preempts single ops; the median drops that).  Printed per (p, m): the first and the last micro-batch's
   latency, the throughput in samples/s, and the throughput over one device's (p = 1, m = 1).
   The closed forms for p equal stages of time t (`pipelab/schedules/inference.py`): latency
   p·t whatever m; throughput m / ((m + p − 1)·t) micro-batches/s.
2. Two real processes (gloo, wall clock): pipelab's `DistributedPipeline.infer` against PyTorch's
   `ScheduleGPipe.eval` (forward only: the GPipe schedule with its backward switched off) on the
   same ranks and blocks, m in {1, 8}; median of 7 passes each, alternating; the outputs compared.
3. Generation (`Pipeline.generate`, greedy, a key/value cache per lane on every stage): a tiny GPT
   (8 layers, d_model 512), 16 prompts of 8 tokens, 24 new tokens each; tokens/s for p in {1, 4}
   and 1, 4 or 8 lanes, against one device (p = 1, all 16 prompts as one lane) and against one
   lane on the same p; every run's text asserted equal to the single device's.  Replayed: each
   op timed in this process, one clock per stage (G actions, `pl.schedules.generation`, run by the step driver).
4. Generation on two real processes (`DistributedPipeline.generate`, gloo): the same GPT and prompts,
   one stage per rank, 1, 2 or 4 lanes; tokens/s on the wall clock (the best of 3) and the text
   asserted equal to part 3's.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import pipelab as pl

DEPTH, WIDTH, BATCH = 8, 512, 256


def local_table() -> None:
    torch.set_num_threads(1)
    model = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0).eval()
    x, y = pl.models.sample_batch(model, BATCH)
    print(f"1. local engine: mlp {DEPTH} x {WIDTH}, batch {BATCH}  (latency in ms, throughput in samples/s)")
    print(f"{'p':>2} {'m':>3}  {'first latency sim/meas':>23}  {'last latency sim/meas':>22}  "
          f"{'throughput sim/meas':>20}  {'meas / one device':>17}")
    base = None
    for p in (1, 2, 4, 8):
        for m in (1, 4, 16):
            pipe = pl.Pipeline(model, n_stages=p, n_microbatches=m, schedule="gpipe", loss_fn=nn.MSELoss(),
                               devices="cpu")
            costs = pl.Costs.from_profile(model, pipe.partition, (x[:BATCH // m], y[:BATCH // m]), nn.MSELoss())
            simulated = pl.simulate(pl.schedules.inference(p, m), costs)
            passes = [pipe.infer(x).trace for _ in range(5)]
            schedule = pl.schedules.forward_only_like(pipe.schedule)
            medians = {a: statistics.median(t.durations()[a] for t in passes) for a in schedule.all_actions()}
            measured = pl.simulate(schedule, medians)  # each op's median over the passes, on one clock per stage
            sim_rate, rate = BATCH / simulated.makespan, BATCH / measured.makespan
            base = rate if base is None else base
            print(f"{p:>2} {m:>3}  {simulated.latencies[0] * 1e3:10.2f} / {measured.latencies[0] * 1e3:8.2f}  "
                  f"{simulated.latencies[-1] * 1e3:10.2f} / {measured.latencies[-1] * 1e3:8.2f}  "
                  f"{sim_rate:9.0f} / {rate:8.0f}  {rate / base:17.2f}")


def on_rank() -> dict:
    """Every rank: pipelab's infer and PyTorch's ScheduleGPipe.eval, alternating; medians and the outputs."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    found = {}
    for m in (1, 8):
        model_pl = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0).eval()
        x, _ = pl.models.sample_batch(model_pl, BATCH)
        pipe = pl.DistributedPipeline(model_pl, n_microbatches=m, schedule="gpipe", loss_fn=nn.MSELoss())
        model_pt = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0).eval()
        a, b = pl.split(model_pt, p).bounds[rank]
        example = torch.empty(BATCH // m, WIDTH)
        stage = PipelineStage(model_pt[a:b], rank, p, torch.device("cpu"), input_args=example, output_args=example)
        schedule = ScheduleGPipe(stage, m)
        times = {"pipelab": [], "torch": []}
        outputs = {}
        for _ in range(7):
            dist.barrier()
            begin = time.perf_counter()
            outputs["pipelab"] = pipe.infer(x).output
            times["pipelab"].append(time.perf_counter() - begin)
            dist.barrier()
            begin = time.perf_counter()
            with torch.no_grad():
                outputs["torch"] = schedule.eval(x) if rank == 0 else schedule.eval()
            times["torch"].append(time.perf_counter() - begin)
        found[m] = {name: statistics.median(t) for name, t in times.items()}
        if rank == p - 1:
            with torch.no_grad():
                expected = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0).eval()(x)
            found[m]["difference"] = max(float((outputs[name] - expected).abs().max()) for name in outputs)
    return found


def processes_table() -> None:
    per_rank = pl.distributed.launch(on_rank, 2, timeout_seconds=300)
    print(f"\n2. two processes (gloo, wall clock, slowest rank's median of 7): mlp {DEPTH} x {WIDTH}, batch {BATCH}")
    print(f"{'m':>3}  {'pipelab infer (ms)':>18}  {'PyTorch ScheduleGPipe.eval (ms)':>31}  {'ratio':>6}  max |output diff|")
    for m in (1, 8):
        ours = max(r[m]["pipelab"] for r in per_rank)
        theirs = max(r[m]["torch"] for r in per_rank)
        print(f"{m:>3}  {ours * 1e3:18.1f}  {theirs * 1e3:31.1f}  {ours / theirs:6.2f}  {per_rank[-1][m]['difference']:.1e}")


def generation_table() -> torch.Tensor:
    torch.set_num_threads(1)
    gpt, prompts = generation_model()
    print("\n3. generation: tiny GPT 8 x 512, 16 prompts of 8 tokens, 24 new tokens each (replayed)")
    print(f"{'p':>2} {'lanes':>5}  {'tokens/s':>9}  {'over one device':>15}  {'over one lane':>13}  {'bubble':>6}")
    reference, base, one_lane = None, None, {}
    for p in (1, 4):
        for lanes in (1, 4, 8):
            pipe = pl.Pipeline(gpt, n_stages=p, n_microbatches=lanes, loss_fn=pl.models.default_loss(gpt),
                               devices="cpu")
            pipe.generate(prompts[:lanes], 2)  # warm up
            result = max((pipe.generate(prompts, 24) for _ in range(3)), key=lambda r: r.tokens_per_second)
            reference = result.tokens if reference is None else reference
            assert torch.equal(result.tokens, reference), "the same greedy text on every layout"
            rate = result.tokens_per_second
            base = rate if base is None else base
            one_lane.setdefault(p, rate)
            print(f"{p:>2} {lanes:>5}  {rate:9.0f}  {rate / base:15.2f}  {rate / one_lane[p]:13.2f}  "
                  f"{result.trace.bubble_fraction:6.1%}")
    return reference


def generating_rank() -> list:
    """Every rank: (lanes, tokens/s of the best of 3, the tokens) for 1, 2 and 4 lanes."""
    torch.set_num_threads(1)
    gpt, prompts = generation_model()
    found = []
    for lanes in (1, 2, 4):
        pipe = pl.DistributedPipeline(gpt, n_microbatches=lanes, loss_fn=pl.models.default_loss(gpt))
        pipe.generate(prompts[:lanes], 2)  # warm up
        best = max((pipe.generate(prompts, 24) for _ in range(3)), key=lambda r: r.tokens_per_second)
        found.append((lanes, best.tokens_per_second, best.tokens))
    return found


def generation_model():
    gpt = pl.models.tiny_gpt(n_layers=8, d_model=512, n_heads=8, vocab_size=256, seq_len=64, seed=0).eval()
    return gpt, torch.randint(0, 256, (16, 8), generator=torch.Generator().manual_seed(0))


def processes_generation_table(reference: torch.Tensor) -> None:
    per_rank = pl.distributed.launch(generating_rank, 2, timeout_seconds=300)
    print("\n4. generation on two processes (gloo, wall clock, best of 3): the same GPT and prompts, one stage a rank")
    print(f"{'lanes':>5}  {'tokens/s':>9}  {'over one lane':>13}")
    for lanes, rate, tokens in per_rank[0]:
        assert torch.equal(tokens, reference), "the single device's greedy text"
        print(f"{lanes:>5}  {rate:9.0f}  {rate / per_rank[0][0][1]:13.2f}")


def main() -> None:
    local_table()
    processes_table()
    reference = generation_table()
    processes_generation_table(reference)


if __name__ == "__main__":
    main()
