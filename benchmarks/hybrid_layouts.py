"""Every way to lay 4 ranks out as dp × pp × tp, on an MLP and a tiny GPT: time, bytes per kind, memory.

    .venv/bin/python benchmarks/hybrid_layouts.py [--rounds 3] [--steps 2] [--ranks 4]

One `pl.distributed.launch` of 4 local gloo ranks (one intra-op thread each) builds, for
each model and each of the six layouts with dp·pp·tp = 4 (`pl.Layout.all_for(4)`), a
`pl.DistributedPipeline(..., layout=)` with 1F1B and m = 4 micro-batches.  Then:

- one warm-up step; one step inside `pipe.count_communication()` (the real calls, per rank);
- rounds that alternate the layouts: `--steps` steps each, timed from a barrier to the
  slowest rank's return (median over all timed steps);
- the closed forms of `predict/comm_formulas.py` for the same ranks (Megatron-LM, ZeRO).

Printed, one row per (model, layout): median step time; per kind the bytes of one step
summed over the 4 ranks, measured / formula ("pp": point-to-point sends between stages;
"gather": the all-gather over "tp" that rebuilds a boundary activation sent in t slices;
"tp": DTensor's all-reduces inside layers; "dp": the gradient all-reduce's payload, and what
a ring puts on the wire, 2(d-1)/d of it); the largest parameter bytes on one rank; and
|loss - single-device loss|.  The models: `mlp(depth=8, width=256)` on 64 samples and
`tiny_gpt(n_layers=4, d_model=64, n_heads=4, seq_len=32)` on 16 sequences.

On 2 shared cores with 4 ranks the times say little about a cluster (the ranks share the
cores, and a collective between processes of one machine costs what an op costs); the
bytes are what the layouts move, the same on any machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pipelab as pl
from pipelab.predict.communication import ring_allreduce_elements_per_device
from pipelab.predict.comm_formulas import STEP_KINDS as KINDS
from pipelab.predict.comm_formulas import step_bytes

MODELS = {"mlp": dict(batch=64), "gpt": dict(batch=16)}
MICROBATCHES = 4


def make_model(kind: str):
    if kind == "mlp":
        return pl.models.mlp(depth=8, width=256, seed=0)
    return pl.models.tiny_gpt(n_layers=4, d_model=64, n_heads=4, vocab_size=128, seq_len=32, seed=0)


def on_each_rank(world: int, rounds: int, steps: int) -> dict:
    import torch.distributed as dist

    pipes, batches, found = {}, {}, {}
    for kind in MODELS:
        model = make_model(kind)
        batches[kind] = pl.models.sample_batch(model, MODELS[kind]["batch"], seed=1)
        for layout in pl.Layout.all_for(world):
            model = make_model(kind)
            pipe = pl.DistributedPipeline(model, n_microbatches=MICROBATCHES, schedule="1f1b",
                                          loss_fn=pl.models.default_loss(model), layout=layout)
            pipe.step(*batches[kind])  # warm-up (and the shape headers)
            with pipe.count_communication() as counter:
                result = pipe.step(*batches[kind])
            pipes[kind, layout] = pipe
            found[kind, layout] = {"loss": result.loss, "counts": counter.totals(), "times": [],
                                   "parameter_bytes": pipe.parameter_bytes(), "bounds": pipe.partition.bounds}
    for r in range(rounds):
        order = list(pipes) if r % 2 == 0 else list(reversed(pipes))
        for key in order:
            for _ in range(steps):
                for p in pipes[key].parameters():
                    p.grad = None
                dist.barrier()
                begin = time.perf_counter()
                pipes[key].step(*batches[key[0]])
                took = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                found[key]["times"].append(took.item())
    return found


def single_device_loss(kind: str) -> float:
    model = make_model(kind)
    x, y = pl.models.sample_batch(model, MODELS[kind]["batch"], seed=1)
    with torch.no_grad():
        return pl.models.default_loss(model)(model(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    per_rank = pl.distributed.launch(on_each_rank, args.ranks, args.ranks, args.rounds, args.steps,
                                     timeout_seconds=600)
    header = (f"{'model':5} {'layout':16} {'step ms':>8} | {'pp: measured/formula':^23} | {'gather':^23} | "
              f"{'tp':^23} | {'dp payload':^23} {'dp wire':>10} | {'params/rank':>11} | {'|Δloss|':>8}")
    print(f"{args.ranks} gloo ranks, 1F1B, m={MICROBATCHES}; bytes of one step summed over the ranks")
    print(header)
    print("-" * len(header))
    built = {kind: make_model(kind) for kind in MODELS}
    single = {kind: single_device_loss(kind) for kind in MODELS}
    for (kind, layout), first in per_rank[0].items():
        counted, formula = step_bytes([rank[kind, layout]["counts"] for rank in per_rank], built[kind], layout,
                                      MODELS[kind]["batch"], MICROBATCHES, first["bounds"])
        wire = ring_allreduce_elements_per_device(counted["dp"], layout.dp)  # bytes in, bytes out
        params = max(rank[kind, layout]["parameter_bytes"] for rank in per_rank)
        loss_error = abs(first["loss"] - single[kind])
        cells = " | ".join(f"{counted[k]:>11,}/{formula[k]:<11,}" for k in KINDS)
        print(f"{kind:5} {str(layout):16} {statistics.median(first['times']) * 1e3:8.1f} | {cells} {wire:10,.0f} | "
              f"{params:11,} | {loss_error:8.1e}")


if __name__ == "__main__":
    main()
