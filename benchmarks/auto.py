"""split_method="auto", schedule="auto" checked by running it: Hugging Face GPT-2 on 2 gloo ranks.

    .venv/bin/python benchmarks/auto.py [--rounds 3] [--warmup 1] [--within 0.10] [--candidates 5]
                                        [--vocab 8192] [--batch 32] [--no-torch]
    .venv/bin/python benchmarks/auto.py --mlp [--rounds 8]

The model, batch and m are `benchmarks/your_model.py`'s: GPT2LMHeadModel(n_layer=8, n_embd=512, n_head=8,
seq 128, vocab 8192, use_cache=False), eval mode, 32 x 128 tokens, m = 8 micro-batches of 4, one intra-op
thread per rank.  In one launch of 2 ranks:

1. pipelab decides (rank 0 profiles every piece: embeddings, each block's attention and MLP, the LM head
   with the loss; it measures the link; every candidate cut x schedule is simulated) and builds the
   choice; every candidate predicted within `--within` of it is built too (at most `--candidates`).
2. pipelab's own named schedules (GPipe, 1F1B, ZB-H1) at its `split_method="time"` cut (whole blocks).
3. PyTorch's `ScheduleGPipe` and `Schedule1F1B` at the middle block (`transformer.h.4`), as in
   `your_model.py` (`--no-torch` leaves them out).

Rounds alternate: each round runs one step of every pipeline, in turn; `--warmup` untimed rounds first.  A
step's time is from a barrier to the rank's return, the slower rank's; medians over rounds.  Printed: each
candidate's predicted step against its measured makespan (pipelab's trace) and its wall step; the regret
of the choice (its wall step over the fastest measured candidate's); the choice against PyTorch's best and
against pipelab's best named schedule at the time cut; and the loss and the gradients of the chosen
pipeline against the single-device step (this rank's parameters, the tied embedding summed over both).

`--mlp`: `vs_torch_pipelining.py`'s MLP instead (8 blocks of width 1024, batch 64, m = 8, MSE), pipelab's
1F1B at the uniform cut (what a user would pick) against "auto": auto / 1F1B, target <= 1.02.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import pipelab as pl  # noqa: E402
from your_model import M, SPLIT, _barrier_timed, _cpu_pressure, causal_lm_loss, make_batch, make_model  # noqa: E402

NAMED = ("gpipe", "1f1b", "zb-h1")


def on_rank(rounds: int, warmup: int, within: float, max_candidates: int, vocab: int, batch_size: int,
            with_torch: bool) -> dict:
    from torch.distributed import pipelining as pp

    warnings.filterwarnings("ignore", category=FutureWarning)
    rank = dist.get_rank()
    batch = make_batch(vocab, batch_size)
    options = dict(n_microbatches=M, sample=batch, loss_normalization="samples")
    began = time.perf_counter()
    chosen_model = make_model(vocab)
    auto = pl.DistributedPipeline(chosen_model, split_method="auto", schedule="auto", **options)
    decided_in = time.perf_counter() - began
    plan = auto.plan
    steps: dict = {}  # label -> a function running one step
    labels: dict = {}  # label -> what it is
    candidates = plan.within(within)[:max_candidates]
    for k, candidate in enumerate(candidates):
        label = f"candidate {k}"
        if k == 0:
            pipe, model = auto, chosen_model
        else:
            model = make_model(vocab)
            schedule = candidate.schedule_name if candidate.schedule_name in NAMED else candidate.schedule
            pipe = pl.DistributedPipeline(model, schedule=schedule, split_points=plan.split_points(candidate),
                                          **options)
        steps[label] = (pipe, model)
        labels[label] = (", ".join(plan.split_points(candidate)), candidate.schedule_name, candidate.predicted)
    for name in NAMED:
        model = make_model(vocab)
        steps[f"time {name}"] = (pl.DistributedPipeline(model, schedule=name, split_method="time", **options), model)
    torch_steps = {}
    if with_torch:
        model_pt = make_model(vocab)
        mb = batch_size // M
        ir = pp.pipeline(model_pt, mb_args=(batch["input_ids"][:mb],), split_spec={SPLIT: pp.SplitPoint.BEGINNING})
        stage_module = ir.get_stage_module(rank)
        for name, cls in (("gpipe", pp.ScheduleGPipe), ("1f1b", pp.Schedule1F1B)):
            torch_steps[f"torch {name}"] = cls(ir.build_stage(rank, torch.device("cpu")), M, loss_fn=causal_lm_loss,
                                               scale_grads=True)

    times = {label: [] for label in [*steps, *torch_steps]}
    makespans = {label: [] for label in steps}
    results = {}

    def run_pipelab(label: str):
        pipe, model = steps[label]
        model.zero_grad(set_to_none=True)
        results[label] = pipe.step(batch)

    def run_torch(label: str):
        stage_module.zero_grad(set_to_none=True)
        if rank == 0:
            torch_steps[label].step(batch["input_ids"], return_outputs=False)
        else:
            torch_steps[label].step(target=batch["labels"], losses=[], return_outputs=False)

    order = [*steps, *torch_steps]
    for r in range(warmup + rounds):
        turn = order[r % len(order):] + order[:r % len(order)]  # each pipeline first in turn
        for label in turn:
            run = (lambda label=label: run_pipelab(label)) if label in steps else (lambda label=label: run_torch(label))
            seconds = _barrier_timed(run, [])
            if r >= warmup:
                times[label].append(seconds)
                if label in steps:
                    makespans[label].append(results[label].trace.makespan)
    run_pipelab("candidate 0")  # the chosen pipeline's gradients, against one device's below
    grads = {n: p.grad.clone() for n, p in chosen_model.named_parameters(remove_duplicate=False)
             if p.device.type != "meta" and p.grad is not None}
    return {"rank": rank, "times": times, "makespans": makespans, "labels": labels, "plan": str(plan.table(10)),
            "link": plan.link, "engine": plan.engine, "decided_in": decided_in, "loss": results["candidate 0"].loss, "grads": grads,
            "chosen": plan.split_points(), "chosen_schedule": plan.chosen.schedule_name}


def on_rank_mlp(rounds: int, warmup: int) -> dict:
    """`vs_torch_pipelining.py`'s MLP (8 blocks of width 1024, batch 64, m = 8, MSE): pipelab's 1F1B at the
    uniform cut (what a user would pick) against split_method="auto", schedule="auto"."""
    model_auto = pl.models.mlp(depth=8, width=1024, seed=0)
    x, y = pl.models.sample_batch(model_auto, 64, seed=1)
    loss = torch.nn.functional.mse_loss
    pipes = {"1f1b": (pl.DistributedPipeline(pl.models.mlp(depth=8, width=1024, seed=0), n_microbatches=M,
                                             schedule="1f1b", loss_fn=loss), None),
             "auto": (pl.DistributedPipeline(model_auto, n_microbatches=M, split_method="auto", schedule="auto",
                                             sample=(x, y), loss_fn=loss), None)}
    times = {label: [] for label in pipes}
    for r in range(warmup + rounds):
        for label in (list(pipes) if r % 2 == 0 else list(pipes)[::-1]):
            seconds = _barrier_timed(lambda label=label: pipes[label][0].step(x, y), [])
            if r >= warmup:
                times[label].append(seconds)
    plan = pipes["auto"][0].plan
    engine = ", ".join(f"{family}: {o * 1e6:.0f} us an action, {lat * 1e6:.0f} us a message"
                       for family, (o, lat) in plan.engine.items())
    return {"times": times, "plan": plan.table(4) + f"\nthe engine measured: {engine}; {plan.link[1] / 2**30:.2f} GiB/s"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--within", type=float, default=0.10)
    parser.add_argument("--candidates", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--mlp", action="store_true", help="only the MLP part: auto against 1F1B at the uniform cut")
    args = parser.parse_args()
    if args.mlp:
        first, second = pl.distributed.launch(on_rank_mlp, 2, max(args.rounds, 8), args.warmup, timeout_seconds=600)
        wall = {label: statistics.median(max(a, b) for a, b in zip(first["times"][label], second["times"][label]))
                for label in first["times"]}
        print(f"MLP 8 x 1024, batch 64, m = {M}, 2 gloo ranks; CPU pressure {_cpu_pressure()}\n{first['plan']}\n")
        print(f"step: 1F1B uniform {wall['1f1b'] * 1e3:.1f} ms, auto {wall['auto'] * 1e3:.1f} ms; "
              f"auto / 1F1B {wall['auto'] / wall['1f1b']:.3f} (target <= 1.02)")
        return
    first, second = pl.distributed.launch(on_rank, 2, args.rounds, args.warmup, args.within, args.candidates,
                                          args.vocab, args.batch, not args.no_torch, timeout_seconds=args.timeout)
    wall = {label: statistics.median(max(a, b) for a, b in zip(first["times"][label], second["times"][label]))
            for label in first["times"]}
    span = {label: statistics.median(values) for label, values in first["makespans"].items()}
    print(f"GPT-2 (8 x 512, vocab {args.vocab}), {args.batch} x 128 tokens, m = {M}, 2 gloo ranks; "
          f"medians of {args.rounds} rounds; CPU pressure (some task waiting for a CPU, last 60 s): {_cpu_pressure()}")
    engine = ", ".join(f"{family} {o * 1e6:.0f} us an action, {lat * 1e6:.0f} us a message"
                       for family, (o, lat) in first["engine"].items())
    print(f"link probed: latency {first['link'][0] * 1e6:.0f} us, bandwidth {first['link'][1] / 2**30:.2f} GiB/s; "
          f"the engine measured: {engine}; decided (profile + price) and built in {first['decided_in']:.1f} s\n")
    print(first["plan"], "\n")
    cut_width = max(len("(time cut)"), *(len(cut) for cut, _, _ in first["labels"].values()))
    print(f"{'':<12} {'cut before':<{cut_width}} {'schedule':<28} {'predicted':>9} {'makespan':>9} {'pred/meas':>9} "
          f"{'step':>8}")
    for label, (cut, schedule, predicted) in first["labels"].items():
        print(f"{label:<12} {cut:<{cut_width}} {schedule:<28} {predicted * 1e3:7.0f}ms {span[label] * 1e3:7.0f}ms "
              f"{predicted / span[label]:9.3f} {wall[label] * 1e3:6.0f}ms")
    for label in [lab for lab in wall if not lab.startswith("candidate")]:
        extra = f"{span[label] * 1e3:7.0f}ms" if label in span else f"{'':>9}"
        print(f"{label:<12} {'(time cut)' if label.startswith('time') else SPLIT:<{cut_width}} {label.split()[1]:<28} "
              f"{'':>9} {extra} {'':>9} {wall[label] * 1e3:6.0f}ms")
    chosen = wall["candidate 0"]
    fastest = min(wall[label] for label in first["labels"])
    print(f"\nregret of the choice: {chosen / fastest:.3f} (its step over the fastest measured candidate's; "
          "target <= 1.05)")
    print(f"predicted / measured makespan of the choice: {first['labels']['candidate 0'][2] / span['candidate 0']:.3f} "
          "(target within 10 %)")
    own = min(wall[f"time {name}"] for name in NAMED)
    print(f"auto / pipelab's best named schedule at the time cut: {chosen / own:.3f} (target <= 1.00)")
    torch_labels = [label for label in wall if label.startswith("torch")]
    if torch_labels:
        best = min(wall[label] for label in torch_labels)
        print(f"auto / PyTorch's best (GPipe, 1F1B at {SPLIT}): {chosen / best:.3f} (target <= 0.85)")
    model, batch = make_model(args.vocab), make_batch(args.vocab, args.batch)
    reference = model(**batch).loss
    reference.backward()
    grads = dict(model.named_parameters(remove_duplicate=False))
    worst = 0.0
    for rank in (first, second):
        for name, grad in rank["grads"].items():
            worst = max(worst, float((grad - grads[name].grad).abs().max() / grads[name].grad.abs().max()))
    print(f"loss: chosen pipeline {first['loss']:.6f}, one device {reference.item():.6f}; largest relative "
          f"gradient difference {worst:.1e}")


if __name__ == "__main__":
    main()
