"""Pipeline it, or shard it? PP2 × FSDP2 (resharding, kept gathered) against PP2 × DP2 and PP4, on 4 ranks.

    .venv/bin/python benchmarks/pp_fsdp.py [--rounds 7] [--mlp-width 512] [--gpt-width 128]

Per model (`pl.models.mlp(depth=8, width=512)` on 16 samples; `tiny_gpt(n_layers=4, d_model=128,
seq_len=16)` on 16 sequences), one `pl.distributed.launch` of 4 local gloo ranks (one intra-op
thread each) runs `pipelab/course/shard_or_pipeline.py` (lesson 08 §9): each layout with 1F1B,
m = 4 and AdamW; a warm-up step, a step counted (`pipe.count_communication()`), then `--rounds`
training steps (pipe.step and AdamW's step, from a barrier to the slowest rank) in alternating
order, the median kept; and an m sweep (1, 2, 4, 8) of FSDP's gathers.

Printed per layout: the median step time and its ratio to PP4's; the bytes FSDP's all-gathers were
handed in one step, summed over the ranks, counted / `fsdp_communication` (2m·P/d a rank resharding,
P/d kept); everything the step moved; the fullest rank's parameters, gradients and AdamW state
observed after the step (DTensors by their local shard) over `state_bytes_per_rank` (ZeRO's table,
Rajbhandari et al. 2020 §5: ratio 1.00 = equal; AdamW's 4-byte step counts are the difference); the
most gradient bytes held during the step (pipelab accumulates full gradients, then reduce-scatters).

On 2 shared cores the 4 ranks share the cores and a gloo collective costs what copying the bytes
costs: the times say which layout wins *here*; on GPUs FSDP overlaps its gathers with compute.
"""

from __future__ import annotations

import argparse

from pipelab.course import shard_or_pipeline as sop


def report(found: sop.Found) -> None:
    rows = found.layouts
    deep = rows["PP4"]
    print(f"\n{found.kind} (width {found.width}), 1F1B, m={found.n_microbatches}, 4 gloo ranks")
    header = (f"{'layout':15} {'step ms':>8} {'/ PP4':>6} | {'gathered counted/formula':>26} {'moved':>10} | "
              f"{'obs/pred: params':>16} {'grads':>6} {'AdamW':>6} {'state/rank':>10} {'grads in step':>13}")
    print(header)
    print("-" * len(header))
    for row in rows.values():
        ratios = " ".join(f"{row.state_observed[k] / row.state_predicted[k]:{w}.4f}"
                          for k, w in zip(sop.STATE_PARTS, (16, 6, 6)))
        gathered = f"{row.bytes_counted['fsdp_gather']:,}/{row.bytes_formula['fsdp_gather']:,}"
        print(f"{row.choice.name:15} {row.step_seconds * 1e3:8.1f} {row.step_seconds / deep.step_seconds:6.2f} | "
              f"{gathered:>26} {sum(row.bytes_counted.values()):10,} | {ratios} {row.state_bytes:10,} "
              f"{row.gradients_in_step:13,}")
    print("FSDP's gathered bytes per step, summed over the ranks (counted/formula):")
    for reshard, points in found.sweep.items():
        print(f"  reshard_after_forward={reshard!s:5}: " + ", ".join(f"m={m} {c:,}/{f:,}" for m, c, f in points))
    print(sop.answer(found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mlp-width", type=int, default=512)
    parser.add_argument("--gpt-width", type=int, default=128)
    args = parser.parse_args()
    for kind, width in (("mlp", args.mlp_width), ("gpt", args.gpt_width)):
        report(sop.run(kind, n_microbatches=4, sweep=(1, 2, 4, 8), rounds=args.rounds, width=width,
                       timeout_seconds=600))


if __name__ == "__main__":
    main()
