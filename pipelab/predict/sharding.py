"""What ZeRO/FSDP sharding over the d data-parallel replicas does to one pipeline stage's step: the planner's part.

ZeRO (Rajbhandari et al. 2020) shards a replica's model states over the d ranks of its data-parallel group:
stage 1 the optimizer states, 2 also the gradients, 3 also the parameters (PyTorch's FSDP2, pipelab's
`shard="fsdp"`; `fsdp_formulas.py` counts the same for a real model).  For Ψ parameters on a device, s
bytes a value (2, or 4 in fp32) and o optimizer bytes a parameter (12 for mixed-precision Adam, 8 for fp32
Adam), the *peak during a step* on that device:

    zero   parameters        gradients   optimizer
    0      s·Ψ               s·Ψ         o·Ψ
    1      s·Ψ               s·Ψ         o·Ψ/d                                         ZeRO §5.1, P_os
    2      s·Ψ               s·Ψ         o·Ψ/d                                         ZeRO §5.2 would give s·Ψ/d
    3      s·Ψ/d + s·β       s·Ψ         o·Ψ/d     β: the largest block's parameters, gathered at a time

The gradients are whole for every stage: in a pipeline each micro-batch's gradients accumulate *unsharded*
and are reduce-scattered once after the drain (fsdp_formulas.py; torch's pipelining does the same, and it is
why DeepSpeed's pipeline engine refuses ZeRO-2 and -3).  ZeRO-2's saving therefore holds only between steps,
which the planner's peak does not see: a ZeRO-2 row equals the ZeRO-1 row of the same configuration, and the
planner ranks the lower stage first on a tie.  FSDP2 also prefetches the next block (a second β at times):
left out.

Time, communication not overlapped (as the planner does for dp), on the "dp" link (latency α, bandwidth bw):

    zero 0      all-reduce after the drain            2(d−1)/d·s·Ψ/bw + 2(d−1)·α            ZeRO §7.1
    zero 1, 2   reduce-scatter + all-gather           the same bytes on a ring: "no extra communication",
                                                      ZeRO §7.2.1
    zero 3      before every action that computes (F and B, or F, I and W with a split backward: k = 2 or 3),
                an all-gather of each of the stage's n blocks:
                    g = (d−1)/d·s·Ψ/bw + n·(d−1)·α    added to T_F and to T_B (twice for ZB-H1's I and W)
                then one reduce-scatter of the gradients after the drain: (d−1)/d·s·Ψ/bw + n·(d−1)·α

ZeRO §7.2.2: ZeRO-3 moves 3Ψ a step where DP moves 2Ψ (a gather in the forward, one in the backward, the
reduce-scatter); a pipeline runs each stage's forward and backward once per micro-batch, so it gathers k·m
times: (k·m + 1)·(d−1)/d·s·Ψ a step (fsdp_formulas.py: k·m gathers per block with reshard_after_forward=True).
The gathers lengthen every action, so the bubble, (p−1)·(T_F + T_B), grows with them too.

Not offered: ZeRO-3 *without* resharding (`reshard_after_forward=False`: one gather per block and step).  It
holds the gathered parameters and their shard, s·Ψ·(1 + 1/d), besides whole gradients, and moves an
all-reduce's bytes: ZeRO-1's time with more memory, so never faster where ZeRO-1 fits.
"""

from __future__ import annotations

from collections.abc import Sequence

from .communication import ring_allreduce_elements_per_device
from .fsdp_formulas import ZERO_STAGES
from .hybrid_costs import Link, all_reduce_seconds


def check_sharding(stages: Sequence[int]) -> tuple[int, ...]:
    """The ZeRO stages to try, sorted, or a ValueError naming what is wrong."""
    if isinstance(stages, (str, int)) or not isinstance(stages, Sequence) or not stages:
        raise ValueError(f"sharding is a sequence of ZeRO stages to try, some of {ZERO_STAGES} (0: none, 1: "
                         f"optimizer states, 2: + gradients, 3: + parameters, FSDP2), got {stages!r}")
    wrong = [z for z in stages if isinstance(z, bool) or z not in ZERO_STAGES]
    if wrong:
        raise ValueError(f"sharding: {wrong} not a ZeRO stage; ZeRO's stages are 0 (none), 1 (optimizer states), "
                         "2 (+ gradients), 3 (+ parameters, FSDP2)")
    return tuple(sorted(set(stages)))


def computing_actions(schedule: str) -> int:
    """k: the actions per micro-batch that compute with a stage's parameters (ZB-H1 splits the backward)."""
    return 3 if schedule == "zb-h1" else 2


def state_bytes(parameters: float, d: int, zero: int, bytes_per_value: int, optimizer_bytes: int,
                largest_block: float) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer): the bytes a device holds at its peak in a step (module docstring)."""
    whole = parameters * bytes_per_value
    held = whole / d + largest_block * bytes_per_value if zero == 3 else whole
    return held, whole, parameters * optimizer_bytes / (d if zero >= 1 else 1)


def gather_seconds(parameters: float, d: int, n_blocks: int, bytes_per_value: int, link: Link) -> float:
    """g: one all-gather of each of a stage's `n_blocks` blocks, Ψ = `parameters` in all, over d ranks."""
    if d <= 1:
        return 0.0
    return (d - 1) / d * parameters * bytes_per_value / link.bandwidth + n_blocks * (d - 1) * link.latency


def after_drain_seconds(parameters: float, d: int, zero: int, n_blocks: int, bytes_per_value: int,
                        link: Link) -> float:
    """The data-parallel communication after the drain: the all-reduce, its reduce-scatter + all-gather
    (zero 1, 2), or FSDP's reduce-scatter per block (zero 3: the same bytes and latencies as a gather)."""
    if zero == 3:
        return gather_seconds(parameters, d, n_blocks, bytes_per_value, link)
    return all_reduce_seconds(parameters * bytes_per_value, d, link)


def after_drain_bytes(parameters: float, d: int, zero: int, bytes_per_value: int) -> float:
    """Bytes a rank sends after the drain: 2(d−1)/d·s·Ψ, or (d−1)/d·s·Ψ for zero 3's reduce-scatter alone."""
    if zero == 3:
        return (d - 1) / d * parameters * bytes_per_value
    return ring_allreduce_elements_per_device(parameters * bytes_per_value, d)
