"""`pl.plan` on Megatron-LM's cluster: the planner's table for one model, and where SC21 Table 1's layouts rank.

    .venv/bin/python benchmarks/planner.py [--model 145.6B] [--rows 10] [--achieved 0.6] [--skip-measure]

Parts 1 and 2 run nothing on a device: every number is a closed form (pipelab/predict/planner.py).  The cluster
is SC21's (A100-80GB, 8 per node, NVLink inside, 8 × 200 Gb/s InfiniBand between nodes;
`SC21_CLUSTER`); compute at `--achieved` of the 312 TFLOP/s peak.

1. The table `pl.plan(...).table()` prints for `--model` (the fastest configuration of each layout),
   with every option the planner knows (ZB-H1 and selective recomputation included).
2. For each of the four largest rows of SC21 Table 1, the rank of the published (t, p) among the
   planner's layouts (1 = fastest), with the options of 2021 (GPipe, 1F1B, interleaved; no or full
   recomputation) and with all of them, at the table's batch, and the planner's own best layout.
3. Against measurement (a few minutes): 8 scenarios (model, global batch, memory limit) on 4 local gloo
   ranks (`pipelab/course/planner_check.py`): the planner, fed with what the ranks measured, picks a
   layout; every layout that fits runs; printed per scenario: the choice, predicted and measured step,
   its rank among the measured layouts and its regret (measured / fastest measured - 1), then every
   layout's prediction beside its measurement.  Targets: |predicted / measured - 1| <= 15 % and
   regret <= 10 % for the choice.
"""

from __future__ import annotations

import argparse

import pipelab as pl
from pipelab.course import planner_check
from pipelab.predict.transformer_memory import SC21_CLUSTER, SC21_OPTIONS, SC21_TABLE_1


def spec_of(row) -> pl.TransformerSpec:
    _, layers, hidden, heads, *_ = row
    return pl.TransformerSpec(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="145.6B", choices=[row[0] for row in SC21_TABLE_1])
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--achieved", type=float, default=0.6, help="achieved fraction of the peak FLOP/s")
    parser.add_argument("--skip-measure", action="store_true", help="leave out part 3 (the runs on 4 local ranks)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout in part 3")
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
    if not args.skip_measure:
        measure(args.repeats)


def measure(repeats: int) -> None:
    print(f"\n== against measurement: {len(planner_check.SCENARIOS)} scenarios on {planner_check.N_RANKS} local gloo "
          "ranks (this takes a few minutes)")
    outcomes = planner_check.check(planner_check.SCENARIOS, repeats=repeats)
    print(planner_check.table(outcomes))
    errors = [abs(o.choice.error) for o in outcomes]
    regrets = [o.regret for o in outcomes]
    print(f"choice's |predicted/measured - 1|: worst {max(errors):.0%} (target <= 15 %), within 15 % in "
          f"{sum(e <= 0.15 for e in errors)}/{len(errors)}; regret: worst {max(regrets):.1%} (target <= 10 %), "
          f"within 10 % in {sum(r <= 0.10 for r in regrets)}/{len(regrets)}; the fastest layout chosen in "
          f"{sum(o.measured_rank == 1 for o in outcomes)}/{len(outcomes)}")
    c = outcomes[0].calibration
    print(f"calibrated (scenario 1): X_b GFLOP/s per rank {({b: round(x / 1e9, 1) for b, x in c['flops'].items()})}, "
          f"link latency {c['latency'] * 1e3:.2f} ms under load ({c['idle_latency'] * 1e3:.2f} ms idle), "
          f"bandwidth {c['bandwidth'] / 1e9:.2f} GB/s")
    for outcome in outcomes:
        print(planner_check.detail(outcome))


if __name__ == "__main__":
    main()
