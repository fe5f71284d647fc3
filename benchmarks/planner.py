"""`pl.plan` on Megatron-LM's cluster: the planner's table for one model, and where SC21 Table 1's layouts rank.

    .venv/bin/python benchmarks/planner.py [--model 145.6B] [--rows 10] [--achieved 0.6]

Nothing runs on a device: every number is a closed form (pipelab/predict/planner.py).  The cluster
is SC21's (A100-80GB, 8 per node, NVLink inside, 8 × 200 Gb/s InfiniBand between nodes;
`SC21_CLUSTER`); compute at `--achieved` of the 312 TFLOP/s peak.

1. The table `pl.plan(...).table()` prints for `--model` (the fastest configuration of each layout),
   with every option the planner knows (ZB-H1 and selective recomputation included).
2. For each of the four largest rows of SC21 Table 1, the rank of the published (t, p) among the
   planner's layouts (1 = fastest), with the options of 2021 (GPipe, 1F1B, interleaved; no or full
   recomputation) and with all of them, at the table's batch, and the planner's own best layout.
"""

from __future__ import annotations

import argparse

import pipelab as pl
from pipelab.predict.transformer_memory import SC21_CLUSTER, SC21_OPTIONS, SC21_TABLE_1


def spec_of(row) -> pl.TransformerSpec:
    _, layers, hidden, heads, *_ = row
    return pl.TransformerSpec(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="145.6B", choices=[row[0] for row in SC21_TABLE_1])
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--achieved", type=float, default=0.6, help="achieved fraction of the peak FLOP/s")
    args = parser.parse_args()

    row = next(r for r in SC21_TABLE_1 if r[0] == args.model)
    name, _, _, _, t, p, n, batch = row
    print(f"== {name} on {n} A100-80GB, global batch {batch}, every option (published: t={t}, p={p})")
    found = pl.plan(spec_of(row), n_devices=n, global_batch=batch, achieved_fraction=args.achieved, **SC21_CLUSTER)
    print(found.table(n_rows=args.rows))

    print(f"\n== SC21 Table 1: rank of the published (t, p) among the planner's layouts (achieved {args.achieved:.0%})")
    print(f"{'model':<8} {'t':>2} {'p':>3} {'GPUs':>5} {'batch':>5}  {'rank 2021':>9} {'rank all':>8}  "
          f"{'best with 2021 options':<40} {'best with all options'}")
    for row in SC21_TABLE_1:
        name, _, _, _, t, p, n, batch = row
        ranks, bests = [], []
        for options in (SC21_OPTIONS, {}):
            found = pl.plan(spec_of(row), n_devices=n, global_batch=batch, achieved_fraction=args.achieved,
                            **SC21_CLUSTER, **options)
            ranks.append(found.rank_of(pl.Layout(dp=n // (p * t), pp=p, tp=t)))
            best = found.best
            bests.append(f"t={best.layout.tp} p={best.layout.pp} {best.schedule_name} {best.recompute} "
                         f"b={best.micro_batch_size} {best.step_seconds:.1f} s")
        print(f"{name:<8} {t:>2} {p:>3} {n:>5} {batch:>5}  {ranks[0]!s:>9} {ranks[1]!s:>8}  {bests[0]:<40} {bests[1]}")


if __name__ == "__main__":
    main()
