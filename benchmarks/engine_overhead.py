"""How much time does the local engine add on top of the work itself?

For the MLP at p=4, m=8 with ops of at least 1 ms, compare the wall time of the whole
`pipe.step(x, y)` call (everything it does: cutting the batch, the observer, the trace the
engine builds) with the sum of its measured op times (forward / backward of one micro-batch
through one stage):

    overhead = wall time of pipe.step - sum(op times)        share = overhead / wall time

Target: share <= 3 %.  Prints the figures measured in this one run (median of the steps).

    python benchmarks/engine_overhead.py [--device cpu|cuda] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pipelab as pl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()

    model = pl.models.mlp(depth=8, width=args.width, seed=0)
    x, y = pl.models.sample_batch(model, args.batch_size)
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule=args.schedule, loss_fn=nn.MSELoss(),
                       devices=args.device)
    pipe.step(x, y)  # first step: warm-up, not counted
    walls, ops, shortest = [], [], []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        begin = time.perf_counter()
        result = pipe.step(x, y)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - begin)  # the whole call, not the step's own `wall_seconds`
        ops.append(result.op_seconds)
        shortest.append(min(result.trace.durations().values()))
    n_actions = 2 * 4 * 8
    wall, op = statistics.median(walls), statistics.median(ops)
    overhead = statistics.median(w - o for w, o in zip(walls, ops))
    print(f"engine overhead: MLP depth 8 width {args.width}, batch {args.batch_size}, p=4, m=8, {args.schedule}, "
          f"{args.device}, torch {torch.__version__}, {pipe.threads or torch.get_num_threads()} intra-op thread(s) in the step, {args.steps} steps")
    print(f"  shortest op            {statistics.median(shortest) * 1e3:8.2f} ms (target: >= 1 ms)")
    print(f"  pipe.step wall time    {wall * 1e3:8.2f} ms")
    print(f"  sum of op times        {op * 1e3:8.2f} ms")
    print(f"  overhead per action    {overhead / n_actions * 1e6:8.1f} us  ({n_actions} actions)")
    print(f"  overhead share         {overhead / wall:8.2%} of the step  (target <= 3 %: "
          f"{'met' if overhead / wall <= 0.03 else 'NOT met'})")


if __name__ == "__main__":
    main()
