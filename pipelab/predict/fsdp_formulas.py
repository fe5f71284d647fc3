"""The closed forms of FSDP's communication inside a pipeline stage (shard="fsdp"), per rank and step.

ZeRO-3 (Rajbhandari et al. 2020, §5.3 and §7.2.2; FSDP2 is its PyTorch form): a block whose
parameters hold P bytes, sharded over d replicas, keeps P/d on each rank (each parameter's
first dimension padded to a multiple of d); the block is all-gathered before it computes and
its gradient reduce-scattered.  In a pipeline stage with m micro-batches, per block and step:

    all-gathers      1          reshard_after_forward=False (gathered at the first forward, kept
                                until the step's reduce-scatter)
                     k · m      True: once per action that computes with the block, k = 2 (F, B),
                                3 with a split backward (F, I, W), 2 on the first stage of a split
                                backward (its input needs no gradient: I computes nothing)
    reduce-scatters  1          (pipelab accumulates the m micro-batches' full gradients first)

Bytes: an all-gather is given the rank's shard, P/d (what `runtime/comm_count.py` records) and
receives the other ranks' shards, P·(d−1)/d; a reduce-scatter is given the full gradient, P,
and sends P·(d−1)/d of it.

Model states per rank between steps (ZeRO §5, Figure 1), for P bytes of a stage's parameters and
an optimizer keeping `states` tensors the size of each parameter (AdamW: exp_avg, exp_avg_sq, 2):

    ZeRO stage     parameters   gradients   optimizer states
    0 (DP)         P            P           states·P
    1 (os)         P            P           states·P/d
    2 (os+g)       P            P/d         states·P/d
    3 (os+g+p)     P/d          P/d         states·P/d          FSDP2's fully_shard: shard="fsdp"

Inside a step, pipelab (as torch's pipelining) accumulates each micro-batch's *full* gradient
and reduce-scatters once at the end, so a stage holds P of gradients until then, whatever the
stage: the reason DeepSpeed's pipeline engine refuses ZeRO-2 and -3.  Bytes a rank holds during
a step under shard="fsdp" (`step_state_bytes`; `budget.device_memory` with `sharded_over=d`):

    parameters   P/d + the gathered units: the whole stage P when kept gathered
                 (reshard_after_forward=False) or under a split backward (W runs with the stage
                 gathered, `runtime/fsdp_stages.py`), else the stage's own parameters outside its
                 blocks + the two largest blocks (the one computing, the one prefetched)
    gradients    P (the accumulated whole) + P/d (the reduce-scatter's output beside it)
    optimizer    states·P/d
"""

from __future__ import annotations

from torch import nn


def sharding_units(stage: nn.Module) -> list[nn.Module]:
    """The blocks of a stage that FSDP gathers one at a time: a `Sequential`'s blocks; none for a stage of a
    model split by names (`TracedStage`: its graphs read every parameter from one flat module, so the stage is
    gathered whole, one unit)."""
    return list(stage) if isinstance(stage, nn.Sequential) else []


def sharded_bytes(block: nn.Module, d: int) -> int:
    """P/d: the bytes of `block`'s parameters one of d ranks holds, each parameter's first dimension padded to a
    multiple of d (FSDP2's `Shard(0)`)."""
    total = 0
    for p in block.parameters():
        rows = p.shape[0] if p.dim() else 1
        total += -(-rows // d) * (p.numel() // max(rows, 1)) * p.element_size()
    return total


def fsdp_communication(blocks: list[nn.Module], d: int, n_microbatches: int, reshard_after_forward: bool,
                       computing_actions: int = 2) -> dict[str, dict[str, int]]:
    """{"fsdp_gather", "fsdp_reduce_scatter": {"messages", "bytes" (given to the calls), "wire_bytes"}} of one
    rank in one step, for the stage's `blocks` with parameters (module docstring); `computing_actions` is k."""
    blocks = [b for b in blocks if any(True for _ in b.parameters())]
    gathers = computing_actions * n_microbatches if reshard_after_forward else 1
    shards = sum(sharded_bytes(b, d) for b in blocks)
    return {"fsdp_gather": {"messages": gathers * len(blocks), "bytes": gathers * shards,
                            "wire_bytes": gathers * shards * (d - 1)},
            "fsdp_reduce_scatter": {"messages": len(blocks), "bytes": d * shards, "wire_bytes": shards * (d - 1)}}


ZERO_STAGES = (0, 1, 2, 3)


def state_bytes_per_rank(blocks: list[nn.Module], d: int, zero: int, states: int = 2) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer"}: the bytes one of d replicas keeps between steps for the stage
    made of `blocks` under ZeRO stage `zero` (module docstring's table); a sharded part is P/d with FSDP2's
    padding (`sharded_bytes`); `states` tensors per parameter in the optimizer (2: Adam/AdamW; 0: SGD).
    Leaves out what FSDP2 and the optimizer add per tensor (a step count each: a few bytes)."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r}: ZeRO's stages are 0 (none), 1 (optimizer states), 2 (+ gradients), "
                         "3 (+ parameters)")
    whole = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    shard = sum(sharded_bytes(b, d) for b in blocks)
    return {"parameters": shard if zero >= 3 else whole, "gradients": shard if zero >= 2 else whole,
            "optimizer": states * (shard if zero >= 1 else whole)}


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def step_state_bytes(stage: nn.Module, d: int, reshard_after_forward: bool, splits_backward: bool,
                     states: int = 2) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer"}: the most bytes a rank holds of `stage`'s model state during a
    step under shard="fsdp" (module docstring); P counted from the parameters' whole shapes (a DTensor's too)."""
    whole, shard = _bytes(stage), sharded_bytes(stage, d)
    blocks = sorted((_bytes(b) for b in sharding_units(stage)), reverse=True)
    gathered = whole
    if reshard_after_forward and not splits_backward and blocks:
        gathered = min(whole, whole - sum(blocks) + sum(blocks[:2]))
    return {"parameters": shard + gathered, "gradients": whole + shard, "optimizer": states * shard}
