"""pipelab's distributed engine against PyTorch's own `torch.distributed.pipelining`, on the same work.

    .venv/bin/python benchmarks/vs_torch_pipelining.py [--rounds 8] [--steps 2] [--ranks 2 4] [--batch 64]
                                                       [--speedup-batch 2048] [--connections 2]

About 2.5-3 minutes on 2 cores: one launch per p at --batch, then one more p = 2 launch at
--speedup-batch (half the rounds) for the speed-up, where every op takes well over 1 ms.

The work: `pl.models.mlp(depth=8, width=1024, seed=0)` (7 blocks Linear(1024, 1024) + GELU,
then a plain Linear(1024, 1024): both engines run exactly this model), batch 64, m = 8
micro-batches (8 samples each), MSE loss (mean), gloo on local ranks, one intra-op thread
per rank, PyTorch's `return_outputs=False` (pipelab returns no outputs either).  For
each p (2 and 4 ranks) one `pl.distributed.launch` builds, on the same ranks and from the
same seed, pipelab's `DistributedPipeline` (twice: as it runs by default, and with
`fused_accumulation=False`, autograd's own accumulation) and PyTorch's `PipelineStage` +
`ScheduleGPipe` / `Schedule1F1B` (static shapes, `scale_grads=True`: PyTorch divides the
summed micro-batch gradients by m, which with a mean loss per micro-batch of equal size
is the gradient of the batch-mean loss, the same as pipelab's n_i / N weighting).  Then
rounds alternate: N steps of each engine and schedule (each engine first in turn), N
plain single-process steps on rank 0, and a profile of the stage costs.  A step is timed
on every rank from a barrier to the rank's return; its time is the slowest rank's.

Printed (medians over steps, all from this one run):

1. Correctness: the batch losses of both engines (asserted equal to 1e-5 relative) and
   the largest gradient difference of each engine from the plain single-device step.
2. Per (p, schedule): median step time of pipelab and of PyTorch, and the ratio
   pipelab / PyTorch.  Target: <= 0.90.  What pipelab does that PyTorch's stage does not:
   each Linear adds its weight gradient into `.grad` inside the multiply
   (`pipelab/model/fused_accumulation.py`) instead of computing it and adding it after;
   the same pipeline with autograd's accumulation is printed beside it, so the ratio's
   source is visible (without it the two engines are level).  The ranks run with two gloo
   connections per pair of ranks (`GLOO_SOCKET_IFNAME=lo,lo`, as `pl.distributed.launch`
   sets), and pipelab's tags put activations on one and gradients on the other
   (`runtime/p2p.py`); PyTorch's stage sends everything with tag 0, on one.  `--connections 1`
   runs both engines on one, and the CPU its I/O threads use per step is printed.  Also: pipelab's makespan and its own
   `wall_seconds`, and the share of the step the ranks' threads waited for a CPU (Linux
   schedstat), which says how much the machine's other work inflated the step.
3. Speed-up of p = 2 over one process running the same model and batch on one thread
   (forward + backward of the full batch).  Target >= 1.5x on 2 cores (ideal 2*8/9 =
   1.78x for m = 8).  Also printed: the shortest measured op (target >= 1 ms) and the
   speed-up over one process running the same 8 micro-batches one after the other
   (gradient accumulation, fused as in pipelab's stages, so that both sides of this
   factor do the same work), which separates the pipeline's parallelism from the cost of
   smaller matrix products.  So the speed-up over the full batch is
   (full / micro-batched) * (micro-batched / pipelined): the cost of micro-batching times
   the pipeline's own gain.  On a CPU the first factor is far from 1 at small micro-batches:
   an 8-row product reads each 4 MB weight matrix for only 8 rows, so the step becomes
   weight-bandwidth bound, and m micro-batches read the weights m times.  Hence the second
   run at --speedup-batch (256 rows per micro-batch), where products are compute bound and
   micro-batching costs under 10 %.
   Also printed: every rank running that micro-batched process at the same time, and the
   share of its speed alone each keeps side by side (1.0 on independent cores; less where
   they share memory bandwidth or caches).
4. Predicted makespan (`pl.simulate` on `pl.Costs.from_profile` measured inside the
   ranks, on all ranks at once so the CPU load is like the real run) against pipelab's
   measured `trace.makespan` of the same round; the error is the median over rounds.
   Target: within 15 %.  Also printed: the prediction from a profile on rank 0 alone.
   With p = 4 ranks on 2 cores the simulator's premise (one device per stage) does not
   hold; that line is informative.

If a launch fails or hangs (PyTorch's schedules on gloo once hung in batch_isend_irecv,
pytorch#132644; not with torch 2.13, whose `_batch_p2p` posts homogeneous batches as
plain isend/irecv and falls back to batch_isend_irecv, which gloo runs op by op, for
1F1B's mixed ones), `--timeout` stops it and the error says which rank and where.

The machine may be shared: every figure is a median over alternated rounds, and the
kernel's CPU pressure is printed before and after.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import pipelab as pl
from pipelab.model.fused_accumulation import FusedAccumulation
from pipelab.runtime.p2p import loopback_interface

DEPTH, WIDTH, BATCH, M = 8, 1024, 64, 8
SCHEDULES = ("gpipe", "1f1b")
ENGINES = ("pipelab", "plain", "torch")  # "plain": pipelab with fused_accumulation=False


def _runqueue_seconds() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux schedstat; nan elsewhere)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan


def _io_thread_seconds() -> float:
    """CPU seconds run so far by this process's gloo I/O threads ("gloo_tcp_loop", one per device; nan off Linux)."""
    total = 0.0
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() != "gloo_tcp_loop":
                    continue
            with open(f"/proc/self/task/{task}/schedstat") as stats:
                total += int(stats.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan
    return total


def _barrier_timed(fn, waited: list | None = None, io: list | None = None) -> float:
    """Seconds from a barrier (all ranks released together) to this rank's return from fn.

    `waited` gets the share of those seconds this rank's thread waited for a CPU; `io` the
    CPU seconds gloo's I/O threads ran meanwhile.
    """
    dist.barrier()
    queued, io_before = _runqueue_seconds(), _io_thread_seconds()
    begin = time.perf_counter()
    fn()
    seconds = time.perf_counter() - begin
    if waited is not None:
        waited.append((_runqueue_seconds() - queued) / seconds)
    if io is not None:
        io.append(_io_thread_seconds() - io_before)
    return seconds


def _cpu_pressure() -> str:
    """The kernel's CPU pressure (share of time some runnable task waited for a CPU, last 60 s)."""
    try:
        with open("/proc/pressure/cpu") as pressure:
            return pressure.readline().split()[2].split("=")[1] + " %"
    except (OSError, IndexError):
        return "n/a"


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def on_rank(p: int, rounds: int, steps: int, batch: int = BATCH) -> dict:
    """What every rank runs; returns its timings, losses and checks."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from tqdm import tqdm

    torch.set_num_threads(1)
    rank = dist.get_rank()
    loss_fn = nn.MSELoss()
    full = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0)  # profiling and the single-process step
    x, y = pl.models.sample_batch(full, batch, seed=1)
    mb = batch // M
    parts_full = pl.split(full, p)
    bounds = parts_full.bounds

    # the plain single-device step's gradients (every rank, once): the reference for both engines
    loss_fn(full(x), y).backward()
    reference = {n: g.grad.clone() for n, g in full.named_parameters()}
    full.zero_grad(set_to_none=True)

    # pipelab: one model (its other ranks' blocks go to "meta"), one pipeline per schedule
    model_pl = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0)
    pipes = {s: pl.DistributedPipeline(model_pl, n_microbatches=M, schedule=s, loss_fn=loss_fn) for s in SCHEDULES}
    # the same pipelines with autograd's own gradient accumulation: what the fused accumulation is worth
    plain = {s: pl.DistributedPipeline(model_pl, n_microbatches=M, schedule=s, loss_fn=loss_fn,
                                       fused_accumulation=False) for s in SCHEDULES}
    # PyTorch: the same blocks from the same seed, static shapes (no metadata exchange)
    model_pt = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0)
    a, b = bounds[rank]
    submod = model_pt[a:b]
    for k, block in enumerate(model_pt):
        if not a <= k < b:
            block.to("meta")
    example_in = torch.empty(mb, WIDTH, requires_grad=rank > 0)
    example_out = torch.empty(mb, WIDTH, requires_grad=True)  # requires_grad: else no gradient is received
    schedules_pt = {}
    for s, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        stage = PipelineStage(submod, rank, p, torch.device("cpu"), input_args=example_in, output_args=example_out)
        schedules_pt[s] = cls(stage, M, loss_fn=loss_fn, scale_grads=True)

    last_losses: dict = {}

    def step_pl(s: str, engine: str = "pipelab"):
        result = (pipes if engine == "pipelab" else plain)[s].step(x, y)
        last_losses[(engine, s)] = result.loss
        return result

    def step_pt(s: str):
        losses: list = []
        sched = schedules_pt[s]
        if rank == 0:
            sched.step(x, return_outputs=False)
        elif rank == p - 1:
            sched.step(target=y, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        if losses:
            last_losses[("torch", s)] = float(torch.stack([l.detach() for l in losses]).mean())

    def single_step():
        loss_fn(full(x), y).backward()

    fusion = FusedAccumulation(full, list(full.parameters()))

    def accumulated_step():  # the same micro-batches, one after the other, in one process, accumulated as pipelab does
        for xi, yi in zip(x.split(mb), y.split(mb)):
            with fusion:
                out = full(xi)
            (loss_fn(out, yi) / M).backward()

    out = {"rank": rank, "bounds": bounds, "grad_err": {}, "loss": {}, "times": {}, "waited": {}, "io": {}, "makespan": {},
           "inner_wall": {}, "shortest_op": [], "predicted": {}, "predicted_alone": {}, "single": [],
           "accumulated": [], "accumulated_together": []}

    # warm-up (not timed) and the correctness checks: one step of each, gradients against the reference
    def my_grads(model):
        return {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    for s in SCHEDULES:
        for engine, model in (("pipelab", model_pl), ("plain", model_pl), ("torch", model_pt)):
            model.zero_grad(set_to_none=True)
            step_pt(s) if engine == "torch" else step_pl(s, engine)
            grads = my_grads(model)
            own = {n for n in reference if a <= int(n.split(".")[0]) < b}
            assert set(grads) == own, (engine, s, sorted(grads), sorted(own))
            out["grad_err"][(engine, s)] = max(_max_rel(g, reference[n]) for n, g in grads.items())
    for key, value in last_losses.items():
        out["loss"][key] = value

    for key in [(e, s) for s in SCHEDULES for e in ENGINES]:
        out["times"][key], out["waited"][key], out["io"][key] = [], [], []
    for s in SCHEDULES:
        out["makespan"][s], out["inner_wall"][s], out["predicted"][s], out["predicted_alone"][s] = [], [], [], []
    out["round_makespan"] = {s: [] for s in SCHEDULES}

    bar = tqdm(total=rounds, desc=f"p={p}: rounds", disable=rank != 0, file=sys.stderr, leave=True)
    for r in range(rounds):
        engines = ENGINES[r % 3:] + ENGINES[:r % 3]  # each engine first in turn
        for s in SCHEDULES:
            for engine in engines:
                for _ in range(steps):
                    if engine != "torch":
                        model_pl.zero_grad(set_to_none=True)
                        holder = {}
                        seconds = _barrier_timed(lambda: holder.setdefault("r", step_pl(s, engine)),
                                                 out["waited"][(engine, s)], out["io"][(engine, s)])
                        result = holder["r"]
                        if engine == "pipelab":
                            out["makespan"][s].append(result.trace.makespan)
                            out["inner_wall"][s].append(result.wall_seconds)
                            out["shortest_op"].append(min(result.trace.durations().values()))
                    else:
                        model_pt.zero_grad(set_to_none=True)
                        seconds = _barrier_timed(lambda: step_pt(s), out["waited"][(engine, s)], out["io"][(engine, s)])
                    out["times"][(engine, s)].append(seconds)
        for s in SCHEDULES:
            out["round_makespan"][s].append(statistics.median(out["makespan"][s][-steps:]))
        # one process, one thread, the whole model and batch (rank 0; the others wait at the barrier)
        for _ in range(steps):
            full.zero_grad(set_to_none=True)
            seconds = _barrier_timed(single_step if rank == 0 else (lambda: None))
            if rank == 0:
                out["single"].append(seconds)
            full.zero_grad(set_to_none=True)
            seconds = _barrier_timed(accumulated_step if rank == 0 else (lambda: None))
            if rank == 0:
                out["accumulated"].append(seconds)
            # the same work on every rank at once: what running side by side costs each process
            full.zero_grad(set_to_none=True)
            out["accumulated_together"].append(_barrier_timed(accumulated_step))
        # the cost model: profiled on every rank at once (load like the real run), and on rank 0 alone
        sample = (x[:mb], y[:mb])
        dist.barrier()
        costs = pl.Costs.from_profile(full, parts_full, sample, loss_fn)
        for s in SCHEDULES:
            out["predicted"][s].append(pl.simulate(pl.schedules.by_name(s, p, M), costs).makespan)
        dist.barrier()
        if rank == 0:
            costs = pl.Costs.from_profile(full, parts_full, sample, loss_fn)
            for s in SCHEDULES:
                out["predicted_alone"][s].append(pl.simulate(pl.schedules.by_name(s, p, M), costs).makespan)
        dist.barrier()
        bar.update()
    bar.close()
    for key, value in last_losses.items():
        out["loss"][key] = value  # the losses of the last timed steps
    return out


def report(p: int, per_rank: list[dict], batch: int = BATCH) -> dict:
    """Print the figures of one p; return the ones the summary needs."""
    med = statistics.median
    root, last = per_rank[0], per_rank[-1]
    found = {}
    print(f"\np = {p} ranks, blocks per rank {root['bounds']}, {len(root['single'])} single-process steps, "
          f"{len(root['times'][('pipelab', 'gpipe')])} steps per engine and schedule")
    # 1. correctness
    for s in SCHEDULES:
        loss_pl, loss_pt = root["loss"][("pipelab", s)], last["loss"][("torch", s)]
        rel = abs(loss_pl - loss_pt) / abs(loss_pt)
        err = {e: max(r["grad_err"][(e, s)] for r in per_rank) for e in ENGINES}
        print(f"  {s:5s} loss: pipelab {loss_pl:.8f}  PyTorch {loss_pt:.8f}  rel. diff {rel:.1e} (must be <= 1e-5); "
              f"max rel. grad diff vs single-device step: pipelab {err['pipelab']:.1e} (plain accumulation "
              f"{err['plain']:.1e}), PyTorch {err['torch']:.1e}")
        assert rel <= 1e-5, f"p={p} {s}: the losses differ by {rel:.2e} relative"
    # 2. step times: per step the slowest rank's
    for s in SCHEDULES:
        t = {e: med(max(col) for col in zip(*(r["times"][(e, s)] for r in per_rank))) for e in ENGINES}
        waited = {e: med(w for r in per_rank for w in r["waited"][(e, s)]) for e in ENGINES}
        io = {e: med(w for r in per_rank for w in r["io"][(e, s)]) for e in ENGINES}
        ratio = t["pipelab"] / t["torch"]
        found[s] = t
        print(f"  {s:5s} step: pipelab {t['pipelab'] * 1e3:7.1f} ms  PyTorch {t['torch'] * 1e3:7.1f} ms  "
              f"ratio pipelab/PyTorch {ratio:.3f} ("
              f"{'target <= 0.90: ' + ('met' if ratio <= 0.90 else 'missed') if batch == BATCH else 'informative'})")
        print(f"        pipelab with autograd's own accumulation (fused_accumulation=False): {t['plain'] * 1e3:.1f} ms, "
              f"ratio {t['plain'] / t['torch']:.3f}: the fused weight-gradient accumulation is worth "
              f"{1 - t['pipelab'] / t['plain']:.0%} of the step")
        print(f"        pipelab inside its step: makespan (first action start to last end) "
              f"{med(root['makespan'][s]) * 1e3:.1f} ms, its own wall_seconds {med(root['inner_wall'][s]) * 1e3:.1f} ms; "
              f"share of the step a rank waited for a CPU: pipelab {waited['pipelab']:.0%}, PyTorch {waited['torch']:.0%}")
        print(f"        CPU of gloo's I/O threads per step and rank: pipelab {io['pipelab'] * 1e3:.1f} ms, "
              f"PyTorch {io['torch'] * 1e3:.1f} ms")
    # 3. single process
    single, accumulated = med(root["single"]), med(root["accumulated"])
    found["single"], found["accumulated"] = single, accumulated
    found["shortest_op"] = med(root["shortest_op"])
    print(f"  one process, one thread: full-batch step {single * 1e3:.1f} ms; the 8 micro-batches one after "
          f"the other {accumulated * 1e3:.1f} ms; shortest pipelab op (F of one micro-batch on one stage) "
          f"{found['shortest_op'] * 1e3:.2f} ms (needed >= 1 ms: {'yes' if found['shortest_op'] >= 1e-3 else 'no'})")
    together = med(t for r in per_rank for t in r["accumulated_together"])
    found["efficiency"] = accumulated / together
    print(f"  the same micro-batched process on all {p} ranks at once: {together * 1e3:.1f} ms each: side by side, "
          f"each process keeps {found['efficiency']:.0%} of its speed alone (this machine's parallel efficiency)")
    for s in SCHEDULES:
        print(f"  {s:5s} speed-up over one process (full batch): pipelab {single / found[s]['pipelab']:.2f}x, "
              f"PyTorch {single / found[s]['torch']:.2f}x; over the micro-batched process: pipelab "
              f"{accumulated / found[s]['pipelab']:.2f}x, PyTorch {accumulated / found[s]['torch']:.2f}x")
    # 4. prediction: each round's profile against the same round's measured makespan
    for s in SCHEDULES:
        errors = [pred / meas - 1 for pred, meas in zip(root["predicted"][s], root["round_makespan"][s])]
        err = med(errors)
        found[("pred", s)] = err
        note = "" if p <= (os.cpu_count() or 1) else f" (informative only: {p} ranks on {os.cpu_count()} cores)"
        print(f"  {s:5s} makespan: predicted {med(root['predicted'][s]) * 1e3:.1f} ms (profiled on all ranks at once; "
              f"{med(root['predicted_alone'][s]) * 1e3:.1f} ms profiled on rank 0 alone), measured "
              f"{med(root['makespan'][s]) * 1e3:.1f} ms; error per round, median {err:+.1%} "
              f"[{min(errors):+.0%} .. {max(errors):+.0%}] (target within 15 %: {'met' if abs(err) <= 0.15 else 'missed'})"
              f"{note}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="steps per engine and schedule in each round")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=BATCH, help=f"a multiple of {M} (default {BATCH})")
    parser.add_argument("--speedup-batch", type=int, default=2048,
                        help="one more p = 2 run at this batch, for the speed-up (ops >= 1 ms); 0: none")
    parser.add_argument("--connections", type=int, choices=(1, 2), default=2,
                        help="gloo connections per pair of ranks (GLOO_SOCKET_IFNAME=lo or lo,lo; default 2: "
                             "pipelab's activations and gradients then never share one)")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per launch before it counts as a hang")
    args = parser.parse_args()
    if args.batch % M or args.speedup_batch % M:
        parser.error(f"--batch and --speedup-batch must be multiples of m = {M}")

    loopback = loopback_interface() or "lo"
    os.environ["GLOO_SOCKET_IFNAME"] = ",".join([loopback] * args.connections)  # the ranks inherit it
    print(f"pipelab DistributedPipeline vs torch.distributed.pipelining: MLP depth {DEPTH} width {WIDTH} "
          f"(pl.models.mlp: last block a plain Linear), batch {args.batch}, m = {M}, MSE mean, gloo, 1 thread per rank, "
          f"torch {torch.__version__}, {os.cpu_count()} cores; {args.rounds} rounds x {args.steps} steps; "
          f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']} ({args.connections} connection(s) per pair of ranks)")
    print(f"CPU pressure before (kernel PSI, some avg60): {_cpu_pressure()}  -- above a few %, other work shares the "
          "cores and every time below is inflated")
    found = {}
    begin = time.perf_counter()
    runs = [(p, args.batch, args.rounds) for p in args.ranks]
    if args.speedup_batch and 2 in args.ranks:  # the speed-up at a batch whose ops take >= 1 ms
        runs.append((2, args.speedup_batch, max(2, args.rounds // 2)))
    for p, batch, rounds in runs:
        start = time.perf_counter()
        if batch != args.batch:
            print(f"\n--- the speed-up at batch {batch} (micro-batches of {batch // M}), {rounds} rounds ---")
        try:
            per_rank = pl.distributed.launch(on_rank, p, p, rounds, args.steps, batch, timeout_seconds=args.timeout,
                                             wait_timeout_seconds=min(60.0, args.timeout))
        except pl.distributed.DistributedError as error:
            where = "torch/distributed/pipelining" in error.details
            print(f"\np = {p}: FAILED ({'inside PyTorch pipelining' if where else 'see below'}): {error}")
            print("\n".join(error.details.splitlines()[-25:]))
            continue
        print(f"(launch and run of p = {p}: {time.perf_counter() - start:.0f} s)")
        found[(p, batch)] = report(p, per_rank, batch)

    print("\nsummary")
    for (p, batch), f in found.items():
        for s in SCHEDULES:
            ratio = f[s]["pipelab"] / f[s]["torch"]
            verdict = ("informative: the target is for the issue's batch" if batch != BATCH
                       else f"target <= 0.90: {'met' if ratio <= 0.90 else 'missed'}")
            print(f"  p={p} batch {batch} {s:5s}: pipelab/PyTorch {ratio:.3f} ({verdict}); "
                  f"makespan prediction error {f[('pred', s)]:+.1%}")
    for (p, batch), f in found.items():
        if p != 2:
            continue
        for s in SCHEDULES:
            speedup = f["single"] / f[s]["pipelab"]
            judged = batch == args.speedup_batch or not args.speedup_batch
            verdict = f"target >= 1.5x: {'met' if speedup >= 1.5 else 'missed'}" if judged else "informative"
            print(f"  p=2 batch {batch} {s:5s}: pipelab speed-up over one process {speedup:.2f}x "
                  f"({verdict}; ideal 1.78x) = micro-batching "
                  f"{f['single'] / f['accumulated']:.2f}x * pipelining {f['accumulated'] / f[s]['pipelab']:.2f}x; "
                  f"parallel efficiency {f['efficiency']:.0%}; shortest op {f['shortest_op'] * 1e3:.2f} ms")
    print(f"CPU pressure after (some avg60): {_cpu_pressure()}; total {time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
