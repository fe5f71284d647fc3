"""What the fused weight-gradient accumulation is worth, by layer width (`pipelab/model/fused_accumulation.py`).

    .venv/bin/python benchmarks/fused_accumulation.py [--widths 256 512 1024 2048] [--rows 8 64] [--rounds 3]

One process, one intra-op thread: an MLP of 4 blocks Linear(d, d) + GELU runs 8 micro-batches
of `rows` rows, forward and backward one after the other, gradients accumulated into `.grad`:
once by plain autograd, once with every Linear fused (the size threshold set to 0).  Each
figure is the best of 5 steps, best again over rounds that alternate which goes first (other
work only adds time).

Printed: both step times and fused / plain.  Below 1 the fusion saves time.  The engines fuse
only weights of at least `MIN_WEIGHT_ELEMENTS` (512 x 512): below that the Python autograd
function costs more than the pass over the weights it saves.  About 30 s.
"""

from __future__ import annotations

import argparse
import time

import torch

import pipelab as pl
from pipelab.model.fused_accumulation import MIN_WEIGHT_ELEMENTS, FusedAccumulation

MICROBATCHES = 8


def step_seconds(model, x, fusion: FusedAccumulation | None, steps: int = 5) -> float:
    best = float("inf")
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        begin = time.perf_counter()
        for chunk in x.chunk(MICROBATCHES):
            if fusion is None:
                out = model(chunk)
            else:
                with fusion:
                    out = model(chunk)
            out.square().mean().backward()
        best = min(best, time.perf_counter() - begin)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64], help="rows per micro-batch")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"MLP of 4 Linear(d, d) + GELU, {MICROBATCHES} micro-batches, 1 thread, torch {torch.__version__}; "
          f"the engines fuse weights of >= {MIN_WEIGHT_ELEMENTS} elements")
    for width in args.widths:
        model = pl.models.mlp(depth=4, width=width, seed=0)
        fusion = FusedAccumulation(model, list(model.parameters()), min_weight_elements=0)
        for rows in args.rows:
            x = torch.randn(rows * MICROBATCHES, width)
            plain = fused = float("inf")
            for r in range(args.rounds):  # the order flips every round
                for which in (("plain", "fused") if r % 2 == 0 else ("fused", "plain")):
                    if which == "plain":
                        plain = min(plain, step_seconds(model, x, None))
                    else:
                        fused = min(fused, step_seconds(model, x, fusion))
            engines = "fused" if width * width >= MIN_WEIGHT_ELEMENTS else "plain"
            print(f"  d = {width:5d}, {rows:3d} rows: plain {plain * 1e3:8.2f} ms, fused {fused * 1e3:8.2f} ms, "
                  f"fused / plain {fused / plain:.2f} (the engines run it {engines})")


if __name__ == "__main__":
    main()
