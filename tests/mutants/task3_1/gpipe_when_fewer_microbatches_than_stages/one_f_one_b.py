"""Mutant of Task 3.1: GPipe's table whenever m < p ("too few micro-batches for a steady state").

Right for m >= p, and for the stages whose warm-up already takes every micro-batch; but
with m < p the last stages still have a steady state: on p=4, m=2, stage 3 runs
F0 B0 F1 B1, not F0 F1 B0 B1.
"""

from __future__ import annotations


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    if n_microbatches < n_stages:  # BUG: 1F1B still differs from GPipe on the last stages
        return [
            [("F", stage, mb) for mb in range(n_microbatches)]
            + [("B", stage, mb) for mb in range(n_microbatches)]
            for stage in range(n_stages)
        ]
    schedule = []
    for stage in range(n_stages):
        warmup = n_stages - stage - 1
        row = [("F", stage, mb) for mb in range(warmup)]
        for k in range(n_microbatches - warmup):
            row += [("F", stage, warmup + k), ("B", stage, k)]
        row += [("B", stage, mb) for mb in range(n_microbatches - warmup, n_microbatches)]
        schedule.append(row)
    return schedule
